"""The Slurm tests need a Slurm cluster that answers (``make slurm-cluster``): without one
they skip and say why, except where ``AFTERSHOCK_REQUIRE_SLURM=1`` (CI, ``make test-slurm``)
makes that a failure."""

from __future__ import annotations

import os

import pytest


def require(problem: str | None) -> None:
    """Skip (or, under AFTERSHOCK_REQUIRE_SLURM=1, fail) with ``problem`` when there is one."""
    if problem is None:
        return
    if os.environ.get("AFTERSHOCK_REQUIRE_SLURM") == "1":
        pytest.fail(f"AFTERSHOCK_REQUIRE_SLURM=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def slurm() -> None:
    """Any Slurm cluster that Slurm's clients here reach (SLURM_CONF): a site's will do."""
    from aftershock.faults import slurm_cli as _slurm

    require(_slurm.problem())


@pytest.fixture(scope="session")
def test_cluster(slurm: None) -> None:
    """The test cluster of ``make slurm-cluster`` itself (its nodes are containers here)."""
    from aftershock.harness.nodes import slurm_cluster

    require(slurm_cluster.status())
