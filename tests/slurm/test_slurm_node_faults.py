"""Node faults on the Slurm test cluster's containers (faults/node.py): they carry the
cluster's label, not a run's, so a node fault takes one only while the process it targets
there is one of this run's Slurm job; a process of the cluster itself (slurmd), or a run
that names another run's job, is refused, as are the kinds that do not undo (node.kill), and
a heal accepts an undo record for a cluster node only as the cluster's and the journal's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aftershock.faults import FaultUnavailable, ProcessRef, slurm_cli
from aftershock.faults.journal import Journal, UndoContext, UndoRefused
from aftershock.faults.node import FREEZE, KILL, PARTITION

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _slurmd(node: str) -> ProcessRef:
    out = subprocess.run(["pgrep", "-f", f"^/usr/sbin/slurmd.* -N {node}$"],
                         capture_output=True, text=True, check=False).stdout.split()
    assert out, f"no slurmd of {node} on this host"
    ref = ProcessRef.of(int(out[0]))
    assert ref is not None
    return ref


def test_a_cluster_node_is_refused_unless_its_target_is_of_the_runs_job(
        test_cluster: None, tmp_path: Path) -> None:
    journal = Journal.create("cluster-safety", tmp_path)
    slurmd = _slurmd("node1")  # in node1's container, but no job's process
    for kind in (PARTITION, FREEZE):
        with pytest.raises(FaultUnavailable, match="not of this run's job"):
            kind.inject(slurmd, {}, journal)
    with pytest.raises(FaultUnavailable, match="is not of run cluster-safety"):
        KILL.inject(slurmd, {}, journal)  # not undone: never on the cluster, job or not
    states = slurm_cli.run(["sinfo", "--noheader", "--Node", "--format=%N %T"]).split("\n")
    assert not [s for s in states if "down" in s or "drain" in s], states


def test_a_heal_takes_a_cluster_node_record_only_as_the_clusters(
        test_cluster: None, tmp_path: Path) -> None:
    container = subprocess.run(
        ["docker", "inspect", "--format", "{{.Id}}", "aftershock_slurm_node1"],
        capture_output=True, text=True, check=True).stdout.strip()
    context = UndoContext(run_id="abc", folders=(), state=tmp_path)
    record = {"container": container, "run": "abc", "cluster": slurm_cli.TEST_CLUSTER_ID,
              "table": "aftershock_0123456789ab", "pid": 1}
    PARTITION.validate(record, context)
    with pytest.raises(UndoRefused, match="not this journal's run"):
        PARTITION.validate({**record, "run": "other"}, context)
    with pytest.raises(UndoRefused, match="not a node of the Slurm test cluster"):
        PARTITION.validate({**record, "cluster": "someone-elses"}, context)
    with pytest.raises(UndoRefused, match="is not labelled"):
        PARTITION.validate({k: v for k, v in record.items() if k != "cluster"}, context)
