"""The node tests need a real Docker engine: without one they skip and say why, except where
``AFTERSHOCK_REQUIRE_DOCKER=1`` (CI, after `make docker-engine`) makes that a failure."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def engine() -> None:
    from aftershock.faults import _docker

    problem = _docker.engine_problem()
    if problem is None:
        return
    if os.environ.get("AFTERSHOCK_REQUIRE_DOCKER") == "1":
        pytest.fail(f"AFTERSHOCK_REQUIRE_DOCKER=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture
def udp_nodes(engine: None, tmp_path: Path) -> Iterator[Any]:
    """A factory of clusters whose nodes run udp_node.py; every one is removed afterwards."""
    from aftershock.harness.nodes.cluster import Cluster

    made: list[Cluster] = []

    def make(nodes: int = 2, restart: str = "no", max_restarts: int = 0) -> Cluster:
        run_id = uuid.uuid4().hex
        folder = tmp_path / f"nodes-{len(made)}"
        folder.mkdir()
        cluster = Cluster(run_id=run_id, run_dir=folder, nodes=nodes, cwd=folder,
                          env={"NODE_DIR": str(folder)}, restart=restart,
                          max_restarts=max_restarts, mounts=[f"{FIXTURES}:{FIXTURES}:ro"])
        made.append(cluster)
        cluster.make_network()
        cluster.env["NODE_PEERS"] = ",".join(cluster.address(i) for i in range(nodes))
        cluster.start([[sys.executable, str(FIXTURES / "udp_node.py")]] * nodes)
        return cluster

    yield make
    for cluster in made:
        with contextlib.suppress(Exception):
            cluster.stop()
