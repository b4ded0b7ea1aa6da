"""The test cluster of `make slurm-cluster`: two slurmd nodes, each a container with its own
hostname and address, one partition, and Slurm's clients working from this host."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from aftershock.faults import slurm_cli as _slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def _run(*argv: str, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def test_two_nodes_each_with_its_own_hostname_and_address(test_cluster: None) -> None:
    states = _run("sinfo", "--noheader", "--Node", "--format=%N %P %T").split("\n")
    nodes = {line.split()[0]: line.split()[1:] for line in states if line.strip()}
    assert set(nodes) >= {"node0", "node1"}
    assert all(partition.rstrip("*") == "debug" for partition, _ in nodes.values())
    out = _run("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
               "echo $(hostname) $(hostname -i) $SLURM_NODEID")
    seen = sorted(line.split(": ", 1)[1].split() for line in out.splitlines())
    assert [s[0] for s in seen] == ["node0", "node1"]
    assert seen[0][1] != seen[1][1], "two nodes on one address"
    assert all(s[1].startswith("198.18.") for s in seen)


def test_sbatch_squeue_scancel_from_this_host(test_cluster: None, tmp_path: Path) -> None:
    name = _slurm.job_name(f"test{time.monotonic_ns()}")
    job = _run("sbatch", "--parsable", f"--job-name={name}", "--nodes=2",
               f"--output={tmp_path}/out-%j.txt", "--wrap", "srun sleep 300").strip()
    deadline = time.monotonic() + 60
    while _run("squeue", "--noheader", f"--jobs={job}", "--format=%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.2)
    assert _slurm.live_jobs(name) == [job]
    _slurm.cancel_named(name)
    assert _slurm.live_jobs(name) == []
    record = _slurm.show_job(job)
    assert record is not None
    assert record["JobState"] == "CANCELLED"
    assert _slurm.exit_status(record) != 0


def test_up_again_keeps_the_cluster_and_is_fast(test_cluster: None) -> None:
    from aftershock.harness.nodes import slurm_cluster

    before = slurm_cluster.container_ids()
    took = slurm_cluster.up()
    assert slurm_cluster.container_ids() == before
    assert len(before) == 3  # slurmctld and two nodes
    assert took < 10, f"an up cluster took {took:.1f}s to be found up"


def test_down_leaves_nothing_and_up_comes_back_in_well_under_a_minute(
        test_cluster: None) -> None:
    import contextlib

    from aftershock.faults import _docker
    from aftershock.harness.nodes import slurm_cluster

    slurm_cluster.down()
    try:
        assert slurm_cluster.container_ids() == []
        with contextlib.closing(_docker.client()) as api:
            label = f"{_docker.RUN_LABEL}={slurm_cluster.CLUSTER_ID}"
            assert api.networks.list(filters={"label": label}) == []
        assert slurm_cluster._host_munged_pid() is None
        assert not slurm_cluster.munge_socket().parent.exists()
        assert not slurm_cluster.HOST_SLURM_CONF.is_symlink()
        assert not slurm_cluster.state_dir().exists()
        assert slurm_cluster.status() is not None
    finally:
        took = slurm_cluster.up()
    assert took < 30, f"a stopped cluster took {took:.1f}s to come up"
    assert slurm_cluster.status() is None
