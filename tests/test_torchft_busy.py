"""torchft's replica groups on a busy machine (issue 48): a verdict must not depend on load.

On a loaded machine one replica group can train alone before the other has even started.
In the recorded run (examples/torchft_ddp/freeze.yaml, three CPU hogs beside it) group 1
started first and committed steps 0..10 in quorum 1 alone; it was frozen at step 10 (the
job's step); group 0, starting late, formed quorum 2 alone while group 1 was frozen and
committed step 0 from its fresh model; group 1 thawed, both entered quorum 3, and group 0
healed from group 1 (max_step 11). Group 0's step 0 was thrown away: one history with
lost work, not two that both went on, which single_history had said ("split brain: steps
0..0 by generations 1, 2").

Timelines are built from torchft's own lines of that run, read through the real
``torchft`` preset and torchrun's real file layout."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aftershock.harness.run.logprobe import compile_probes, file_fields, line_events
from aftershock.harness.run.records import Event
from aftershock.harness.scenario import presets
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import _single_history

FT = compile_probes(presets.probes("torchft"), "logs")
FAULT = 18.0  # group 1 frozen just after its step 10 was read
THAWED = 23.0
U0, U1 = "80a3d88c-001c-4ea8", "765cdb06-dab2-4a29"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchft_ddp"


def path(group: int) -> str:
    return f"/run/torchrun/group{group}/none_{group}abc/attempt_0/0/stderr.log"


def line(group: int, step: int, text: str, t: float) -> list[Event]:
    """One torchft Manager line of replica group ``group``, read at ``t``."""
    uuid = U0 if group == 0 else U1
    return line_events(f"INFO:torchft.manager:[train_ddp_{group}:{uuid}/0 - step {step}] "
                       f"{text}", FT, read_t=t, clock_offset=0.0, started=0.0,
                       defaults=file_fields(path(group)))


def quorum(group: int, step: int, quorum_id: int, t: float) -> list[Event]:
    return line(group, step, f"reconfiguring for quorum_id={quorum_id} "
                f"store_prefixed_addr='127.0.0.1:29600/torchft/{quorum_id}/0'", t)


def commits(group: int, first: int, last: int, t0: float) -> list[Event]:
    out: list[Event] = []
    for i, s in enumerate(range(first, last + 1)):
        out += line(group, s, "should_commit=True enough_replicas=True, errored=None",
                    t0 + 0.12 * i)
    return out


def started(t: float, pid: int, agent: int) -> Event:
    return Event(t, "process_started", "launcher",
                 {"pid": pid, "role": "worker", "agent": agent, "generation": 0})


def recorded(zombie_steps: int = 0) -> list[Event]:
    """The recorded run. With ``zombie_steps``, group 1 instead goes on in quorum 1 for that
    many steps after group 0 committed step 0 in quorum 2 (two quorums advancing apart),
    before both enter quorum 3."""
    events = [started(14.0, 27012, 26509), started(16.8, 27060, 26508)]
    events += quorum(1, 0, 1, 16.9) + commits(1, 0, 10, 16.95)
    events.append(Event(FAULT, "fault_injected", "harness", {"kind": "process.freeze"}))
    events += quorum(0, 0, 2, 23.15) + commits(0, 0, 0, 23.17)
    events.append(Event(THAWED, "fault_healed", "harness", {"kind": "process.freeze"}))
    events += commits(1, 11, 10 + zombie_steps, 23.2)
    heal = 11 + zombie_steps
    events += quorum(0, 1, 3, 23.9) + quorum(1, heal, 3, 23.9)
    events += line(0, heal, "Loaded state dict.", 24.0)
    events += commits(0, heal, 40, 24.1) + commits(1, heal, 40, 24.1)
    events.append(Event(30.0, "run_end", "harness", {"exit_code": 0}))
    return sorted(events, key=lambda e: e.t)


def test_a_late_group_that_healed_from_the_thawed_one_is_one_history() -> None:
    events = recorded()
    # Read as torchft wrote it: step 0 twice, in quorums 1 and 2; group 0 healed in 3.
    worlds = {(c.launcher, c.step): c.world for c in metrics.commits(events)}
    assert {w for (_, s), w in worlds.items() if s == 0} == {1, 2}
    assert metrics.forked_steps(events) == 0
    check = _single_history(metrics.forked_steps(events), events)
    assert check.passed, check.message
    assert metrics.lost_steps(events) == 1  # group 0's step 0, given up when it healed


@pytest.mark.parametrize("zombie_steps", [1, 3])
def test_a_frozen_group_that_went_on_alone_while_the_other_quorum_trained_forked(
        zombie_steps: int) -> None:
    """Group 1 thawed commits steps in quorum 1 after group 0's quorum 2 committed step 0:
    two quorums advanced apart, whichever one was later given up."""
    events = recorded(zombie_steps)
    assert metrics.forked_steps(events) == 1
    check = _single_history(metrics.forked_steps(events), events)
    assert not check.passed
    assert "split brain" in check.message


def test_a_group_that_healed_into_a_quorum_after_it_trained_there_forked() -> None:
    """Group 1's steps in quorum 3 came before group 0 joined it (lower step numbers than
    the step group 0 healed to): quorum 3 advanced while quorum 2 still did."""
    events = recorded()
    events = [e for e in events if not (e.fields.get("replica") == 0
                                        and e.fields.get("step", 0) >= 11)]
    events += quorum(0, 1, 3, 25.0) + line(0, 20, "Loaded state dict.", 25.1)
    events += commits(0, 1, 1, 23.5)  # quorum 2 went on while quorum 3 trained 11..19
    events += commits(0, 20, 40, 25.2)
    events = sorted(events, key=lambda e: e.t)
    assert metrics.forked_steps(events) == 2  # steps 0 and 1: quorum 1's line went on in 3
    assert not _single_history(metrics.forked_steps(events), events).passed


# ---------------------------------------------------------------------------- run.sh ports

#: Stand-ins for torchft_lighthouse and torchrun: each binds the port run.sh gave it, as the
#: real ones do (failing if it is taken), and writes down what it was given.
STUB = """#!{python}
import json, os, socket, sys, time
args = sys.argv[1:]
if os.path.basename(sys.argv[0]) == "torchft_lighthouse":
    port = int(args[args.index("--bind") + 1].rsplit(":", 1)[1])
else:
    port = int(next(a for a in args if a.startswith("--master-port=")).split("=")[1])
s = socket.socket()
s.bind(("", port))
with open(os.path.join(os.environ["STUB_OUT"], f"{{os.getpid()}}.json"), "w") as f:
    json.dump({{"prog": os.path.basename(sys.argv[0]), "port": port,
               "group": os.environ.get("REPLICA_GROUP_ID"),
               "lighthouse": os.environ.get("TORCHFT_LIGHTHOUSE")}}, f)
time.sleep(30 if "lighthouse" in sys.argv[0] else 1)
"""


def run_sh(tmp_path: Path, env: dict[str, str]) -> list[dict[str, object]]:
    stubs, out = tmp_path / "bin", tmp_path / "out"
    stubs.mkdir()
    out.mkdir()
    for name in ("torchft_lighthouse", "torchrun"):
        (stubs / name).write_text(STUB.format(python=sys.executable))
        (stubs / name).chmod(0o755)
    path = f"{stubs}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run([str(EXAMPLE / "run.sh"), "3"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env, "PATH": path,
                                            "STUB_OUT": str(out), "LOG_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]


def test_run_sh_takes_free_ports_so_two_runs_do_not_collide(tmp_path: Path) -> None:
    """The ports the script used to fix are taken here (as by another run beside it): the
    lighthouse and each group's store still get ports of their own, and the groups are told
    where their lighthouse is."""
    taken = []
    for port in (29510, 29600, 29601):
        s = socket.socket()
        with contextlib.suppress(OSError):  # taken already: by someone else, as well
            s.bind(("", port))
            s.listen()
        taken.append(s)
    try:
        seen = run_sh(tmp_path, {})
    finally:
        for s in taken:
            s.close()
    (lighthouse,) = [r for r in seen if r["prog"] == "torchft_lighthouse"]
    groups = sorted((r for r in seen if r["prog"] == "torchrun"), key=lambda r: str(r["group"]))
    assert [r["group"] for r in groups] == ["0", "1"]
    ports = [lighthouse["port"]] + [r["port"] for r in groups]
    assert len(set(ports)) == 3, ports
    assert all(r["lighthouse"] == f"http://localhost:{lighthouse['port']}" for r in groups)


def test_run_sh_keeps_the_lighthouse_port_it_is_given(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    seen = run_sh(tmp_path, {"LIGHTHOUSE_PORT": str(port)})
    assert {r["port"] for r in seen if r["prog"] == "torchft_lighthouse"} == {port}
