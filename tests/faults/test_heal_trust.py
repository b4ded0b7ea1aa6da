"""`heal` trusts nothing it did not write.

A journal file that is not ours, or lies in a folder others can write, is refused
whole; an undo record in our own journal that names something the run cannot be
proven to have made (a process without the run's id, a table without our prefix,
a path outside the run's folders) is refused; what cannot be read is skipped and
reported, never a crash or a hang; and `aftershock heal` says by its exit code
whether a fault may still be applied. Every victim here is real: processes,
signals, an nftables table, files and folders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import _procmem, registry
from aftershock.faults._proc import ProcessRef, state
from aftershock.faults.heal import heal_journal, heal_orphans
from aftershock.faults.journal import (
    Journal,
    UndoContext,
    UndoRefused,
    UnsafeFolder,
    pending,
    state_dir,
)
from aftershock.faults.registry import Applied, KindInfo
from aftershock.faults.storage import CORRUPT

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534

pytestmark = pytest.mark.timeout(60)


def _nft() -> str | None:
    found = [p for p in (shutil.which("nft"), "/usr/sbin/nft") if p and os.access(p, os.X_OK)]
    return found[0] if found and os.geteuid() == 0 else None


def _tables() -> list[str]:
    nft = _nft()
    if nft is None:
        return []
    out = subprocess.run([nft, "list", "tables", "inet"], capture_output=True, text=True,
                         check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.startswith("table")]


def _wait(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def _sleeper(**env: str) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if k != "AFTERSHOCK_RUN_ID"}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**base, **env})


def _ref(proc: subprocess.Popen[bytes]) -> ProcessRef:
    deadline = time.monotonic() + 5
    while True:  # start time is there as soon as the pid is; wait for exec to finish
        ref = ProcessRef.of(proc.pid)
        if ref is not None and Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(
            sys.executable.encode()
        ):
            return ref
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _anon_byte(pid: int) -> int:
    """An address in the process's anonymous writable memory."""
    region = next(r for r in _procmem.maps(pid) if r.perms.startswith("rw") and r.anonymous)
    return region.start


@dataclass
class Victims:
    """Things an attacker's journal names; none of them may change."""

    procs: list[subprocess.Popen[bytes]]
    plain: ProcessRef  # SOME_VAR=victim in its environment, no run id
    stopped: ProcessRef  # stopped by the test, no run id
    address: int  # in plain's memory
    byte: bytes  # what is there
    folder: Path  # holds mine.txt
    file: Path  # holds b"mine"
    appendee: Path  # must not grow
    stash: Path  # the attacker's folder
    backup: Path  # the attacker's file
    table: str | None  # an nftables table that is not Aftershock's

    def changes(self) -> list[str]:
        found = []
        if not self.plain.alive():
            found.append("plain process killed")
        if state(self.stopped.pid) not in ("T", "t"):
            found.append("stopped process continued")
        elif _procmem.read(self.plain.pid, self.address, 1) != self.byte:
            found.append("memory written")
        if sorted(os.listdir(self.folder)) != ["mine.txt"]:
            found.append(f"folder replaced: {sorted(os.listdir(self.folder))}")
        if self.file.read_bytes() != b"mine":
            found.append("file replaced")
        if self.appendee.read_bytes() != b"mine":
            found.append("file appended to")
        if not self.stash.exists() or not self.backup.exists():
            found.append("attacker's stash consumed")
        if self.table is not None and self.table not in _tables():
            found.append("foreign nftables table deleted")
        return found

    def forged(self) -> list[dict[str, Any]]:
        """The issue's records, and a memory restore and a command-file append."""
        return [
            {"op": "launch", "id": "l1", "kind": "launch",
             "undo": {"env": "SOME_VAR", "value": "victim"}},
            {"op": "fault", "id": "f1", "kind": "process.freeze",
             "undo": self.stopped.to_json()},
            {"op": "fault", "id": "f2", "kind": "net.partition",
             "undo": {"table": self.table or "not_ours"}},
            {"op": "fault", "id": "f3", "kind": "storage.full",
             "undo": {"dir": str(self.folder), "source": "none", "stash": str(self.stash),
                      "write_back": False}},
            {"op": "fault", "id": "f4", "kind": "storage.corrupt",
             "undo": {"path": str(self.file), "backup": str(self.backup)}},
            {"op": "fault", "id": "f5", "kind": "memory.bitflip",
             "undo": {"target": self.plain.to_json(), "restore": True,
                      "writes": [{"address": self.address, "bit": 0,
                                  "old": bytes([self.byte[0] ^ 0xFF]).hex(),
                                  "new": self.byte.hex()}]}},
            {"op": "fault", "id": "f6", "kind": "collective.hang",
             "undo": {"commands": str(self.appendee), "id": "x"}},
        ]


@pytest.fixture
def victims(tmp_path: Path) -> Iterator[Victims]:
    plain, stopped = _sleeper(SOME_VAR="victim"), _sleeper()
    refs = [_ref(plain), _ref(stopped)]
    os.kill(stopped.pid, signal.SIGSTOP)
    assert _wait(lambda: state(stopped.pid) == "T")
    folder = tmp_path / "victim_dir"
    folder.mkdir()
    (folder / "mine.txt").write_text("mine")
    (tmp_path / "victim_file").write_bytes(b"mine")
    (tmp_path / "appendee").write_bytes(b"mine")
    attacker = tmp_path / "attacker"
    (attacker / "stash").mkdir(parents=True)
    (attacker / "stash" / "evil.txt").write_text("evil")
    (attacker / "file").write_bytes(b"evil")
    table = None
    nft = _nft()
    if nft is not None:
        table = f"not_ours_{uuid.uuid4().hex[:8]}"
        subprocess.run([nft, "add", "table", "inet", table], check=True)
    address = _anon_byte(plain.pid)
    made = Victims([plain, stopped], refs[0], refs[1], address,
                   _procmem.read(plain.pid, address, 1), folder, tmp_path / "victim_file",
                   tmp_path / "appendee", attacker / "stash", attacker / "file", table)
    yield made
    for proc in made.procs:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()
    if nft is not None and table is not None:
        subprocess.run([nft, "delete", "table", "inet", table], check=False)


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    """A journal whose harness is long gone (its owner pid cannot exist)."""
    owner = {"t": 0, "op": "owner", "owner": {"pid": 999_999_999, "start": 1}}
    path.write_text("".join(json.dumps(r) + "\n" for r in [owner, *records]))


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a journal owned by another user")


# ----------------------------------------------------------- whole files are refused


def test_foreign_journal_in_a_folder_everyone_can_write_touches_nothing(
    victims: Victims,
) -> None:
    """The issue's reproduction: mode 1777, the file written by `nobody`."""
    _need_root()
    folder = state_dir() / "journal"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o1777)
    evil = folder / "evil.jsonl"
    _write_lines(evil, victims.forged())
    os.chown(evil, NOBODY, NOBODY)
    healed = heal_orphans()
    assert victims.changes() == []
    assert [(h.outcome, h.entry) for h in healed] == [("refused", None)]
    assert "writable by others" in str(healed[0].reason)
    assert evil.exists()  # left for the user to inspect


def test_journal_owned_by_another_user_is_refused(victims: Victims) -> None:
    _need_root()
    folder = state_dir() / "journal"
    folder.mkdir(parents=True, mode=0o700)
    evil = folder / "evil.jsonl"
    _write_lines(evil, victims.forged())
    os.chown(evil, NOBODY, NOBODY)
    healed = heal_orphans()
    assert victims.changes() == []
    assert [(h.outcome, h.journal) for h in healed] == [("refused", evil)]
    assert f"owned by uid {NOBODY}" in str(healed[0].reason)


def test_symlinked_journal_is_refused_and_its_target_untouched(
    victims: Victims, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.jsonl"
    _write_lines(outside, victims.forged())
    before = outside.read_bytes()
    folder = state_dir() / "journal"
    folder.mkdir(parents=True, mode=0o700)
    (folder / "evil.jsonl").symlink_to(outside)
    healed = heal_orphans()
    assert victims.changes() == []
    assert [h.outcome for h in healed] == ["refused"]
    assert "symbolic link" in str(healed[0].reason)
    assert outside.read_bytes() == before  # no "reverted" record appended through the link


# --------------------------------------------------- records in our own journal are checked


def test_forged_records_in_our_own_journal_are_each_refused(
    victims: Victims, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    journal = Journal.create("run-forged", folders=[run])
    state = state_dir()
    near_misses: list[tuple[str, dict[str, Any], str]] = [
        ("launch", {"env": "AFTERSHOCK_RUN_ID", "value": "another-run"}, "run-forged"),
        # A nodes system's record names its containers' label: only that label, this run's.
        ("launch", {"env": "AFTERSHOCK_RUN_ID", "value": "run-forged", "label": "com.other"},
         "com.other"),
        ("storage.full", {"dir": str(run / "ckpt"), "source": "aftershock_0123456789ab",
                          "stash": str(victims.stash), "write_back": True}, "state folder"),
        ("storage.full", {"dir": str(run / "ckpt"), "source": "aftershock_0123456789ab",
                          "stash": str(state / "storage" / "ba9876543210"),
                          "write_back": True}, "aftershock_0123456789ab"),
        ("storage.delete", {"path": str(run / "ckpt"),
                            "backup": str(state / "backup" / "0123456789ab" / "other")}, "ckpt"),
        ("storage.truncate", {"path": str(run / ".." / "victim_file"),
                              "backup": str(state / "backup" / "0123456789ab" / "victim_file")},
         "normal"),
        ("gpu.xid", {"effect": "device_lost", "nvml_dir": str(victims.folder), "gpu": 0},
         "outside this run's folders"),
        ("gpu.xid", {"effect": "hang", "nvml_dir": str(run), "gpu": 0,
                     "target": victims.stopped.to_json()}, "AFTERSHOCK_RUN_ID"),
        ("process.straggle", {"method": "signal", "token": "t", **victims.stopped.to_json()},
         "AFTERSHOCK_RUN_ID"),
        ("process.straggle", {"method": "cgroup", "cgroup": str(victims.folder / "aftershock_x"),
                              "home": str(victims.folder), "root": str(victims.folder)},
         "cgroup"),
        ("net.partition", {"table": "aftershock_0123456789ab",
                           "cgroup": "/sys/fs/cgroup/unified/system.slice",
                           "home": "/sys/fs/cgroup/unified", "root": "/sys/fs/cgroup/unified"},
         "cgroup"),
        ("memory.zero", {"target": victims.plain.to_json(), "restore": True, "writes": []},
         "AFTERSHOCK_RUN_ID"),
        ("process.kill", {}, "validate"),  # never journaled: a record of it is forged
    ]
    ids = {}
    for record in victims.forged():
        ids[journal.intend(record["kind"], record["undo"], op=record["op"])] = (
            record["kind"], None)
    for kind, undo, why in near_misses:
        op = "launch" if kind == "launch" else "fault"
        ids[journal.intend(kind, undo, op=op)] = (kind, why)

    healed = heal_journal(journal.path)

    assert victims.changes() == []
    assert {h.entry.id: h.outcome for h in healed if h.entry} == dict.fromkeys(ids, "refused")
    for item in healed:
        assert item.entry is not None
        why = ids[item.entry.id][1]
        if why is not None:
            assert why in str(item.reason), (item.entry.kind, item.reason)
    # Refused records stay pending: the journal is kept for the user to look at.
    assert len(pending(journal.path)) == len(ids)


def test_records_of_the_run_itself_are_undone(tmp_path: Path) -> None:
    """The positive control: the run's own stopped process is continued, and its launch
    record ends the run's processes and no one else's."""
    journal = Journal.create("run-own", folders=[tmp_path])
    own, other, stranger = (_sleeper(AFTERSHOCK_RUN_ID="run-own"),
                            _sleeper(AFTERSHOCK_RUN_ID="run-other"), _sleeper())
    try:
        refs = [_ref(p) for p in (own, other, stranger)]
        journal.intend("launch", {"env": "AFTERSHOCK_RUN_ID", "value": "run-own"}, op="launch")
        registry.get("process.freeze").inject(refs[0], {}, journal)
        assert _wait(lambda: state(own.pid) == "T")
        healed = heal_journal(journal.path)
        assert [(h.entry.kind if h.entry else None, h.outcome) for h in healed] == [
            ("process.freeze", "undone"), ("launch", "undone")]
        assert _wait(lambda: not refs[0].alive())
        assert refs[1].alive()
        assert refs[2].alive()
        assert not journal.path.exists()
    finally:
        for proc in (own, other, stranger):
            proc.kill()
            proc.wait()


class _NoValidate:
    """A third-party kind that gives no `validate`: its records cannot be checked."""

    info = KindInfo(kind="test.novalidate", summary="test only", caused_by="nothing")
    reverted: list[Mapping[str, Any]] = []  # noqa: RUF012

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        raise NotImplementedError

    def revert(self, undo: Mapping[str, Any]) -> None:
        self.reverted.append(undo)


def test_a_kind_without_validate_is_refused_and_never_reverted(tmp_path: Path) -> None:
    with registry.KINDS.added(_NoValidate()):
        journal = Journal.create("run-novalidate", folders=[tmp_path])
        journal.intend("test.novalidate", {"anything": 1})
        healed = heal_journal(journal.path)
        assert [h.outcome for h in healed] == ["refused"]
        assert "validate" in str(healed[0].reason)
        assert _NoValidate.reverted == []
    assert "test.novalidate" not in registry.KINDS


# ------------------------------------------------ unreadable journals: skipped and reported


def _heal_cli(timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aftershock", "heal"], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ))


def test_bad_files_and_records_are_reported_and_the_rest_is_healed(tmp_path: Path) -> None:
    """A record without `kind`, other malformed records, a FIFO and a folder named like a
    journal: no crash, no hang, each named in the output; a good journal is still healed."""
    folder = state_dir() / "journal"
    folder.mkdir(parents=True, mode=0o700)
    frozen = _sleeper(AFTERSHOCK_RUN_ID="good")
    try:
        ref = _ref(frozen)
        os.kill(frozen.pid, signal.SIGSTOP)
        assert _wait(lambda: state(frozen.pid) == "T")
        _write_lines(folder / "good.jsonl", [
            {"op": "fault", "id": "g1", "kind": "process.freeze", "undo": ref.to_json()}])
        _write_lines(folder / "bad.jsonl", [
            {"op": "fault", "id": "b1", "undo": {}},  # no kind: the KeyError
            {"op": "fault", "id": "b2", "kind": "process.freeze", "undo": "oops"},
        ])
        with open(folder / "bad.jsonl", "a") as handle:
            handle.write("[1, 2]\n")
        os.mkfifo(folder / "fifo.jsonl")
        (folder / "dir.jsonl").mkdir()
        done = _heal_cli()
        assert done.returncode == 2, done.stdout + done.stderr  # refused, nothing failed
        assert "Traceback" not in done.stderr
        out = done.stdout
        assert "fifo.jsonl" in out
        assert "not a regular file" in out
        assert "dir.jsonl" in out
        assert "bad.jsonl" in out
        assert "no kind" in out
        assert "not a JSON object" in out
        assert "undone" in out
        assert "process.freeze" in out
        assert _wait(lambda: state(frozen.pid) in ("S", "R"))
        # A second heal does not hang either, and the bad journal is still there to inspect.
        assert _heal_cli().returncode == 2
        assert (folder / "bad.jsonl").exists()
        assert not (folder / "good.jsonl").exists()
    finally:
        frozen.kill()
        frozen.wait()


def test_heal_exits_1_when_an_undo_failed(tmp_path: Path) -> None:
    """An own, valid record whose undo fails: a fault may still be applied, so CI must see it."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    below = os.stat(run / "ckpt")
    stash = state_dir() / "storage" / "0123456789ab"
    stash.parent.mkdir(parents=True)
    stash.write_text("a file where the stash of what was written should be a folder")
    folder = state_dir() / "journal"
    folder.mkdir(mode=0o700)
    path = folder / "run-fails.jsonl"
    path.write_text(json.dumps({"t": 0, "op": "owner", "owner": None,
                                "folders": [str(run)]}) + "\n" + json.dumps(
        {"t": 0, "op": "fault", "id": "s1", "kind": "storage.full",
         "undo": {"dir": str(run / "ckpt"), "source": "aftershock_0123456789ab",
                  "stash": str(stash), "write_back": True,
                  "below": [below.st_dev, below.st_ino]}}) + "\n")
    os.chmod(path, 0o600)
    done = _heal_cli()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed" in done.stdout
    assert "storage.full" in done.stdout
    assert path.exists()  # still pending: the next heal tries again


def test_heal_exits_0_when_nothing_is_left() -> None:
    done = _heal_cli()
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------ the journal's own file


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    """A harness killed mid-write leaves half a line; the heal's `reverted` record must not
    be glued onto it (the entry would stay pending for ever)."""
    proc = _sleeper(AFTERSHOCK_RUN_ID="run-torn")
    try:
        journal = Journal.create("run-torn")
        registry.get("process.freeze").inject(_ref(proc), {}, journal)
        with open(journal.path, "a") as handle:
            handle.write('{"t":1,"op":"fault","id":"half')
        healed = heal_journal(journal.path)
        assert [h.outcome for h in healed if h.entry] == ["undone"]
        assert [h.outcome for h in healed if not h.entry] == ["skipped"]  # reported, harmless
        assert not journal.path.exists()
    finally:
        proc.kill()
        proc.wait()


def test_state_folders_are_private_whatever_the_umask(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_1.pt").write_bytes(b"w" * 100)
    old = os.umask(0)
    try:
        journal = Journal.create("run-umask", folders=[run])
        CORRUPT.inject(ProcessRef(os.getpid(), 0),
                       {"root": str(run), "path": "*.pt", "restore": True}, journal)
    finally:
        os.umask(old)
    state = state_dir()
    for folder in (state, state / "journal", state / "backup",
                   *(state / "backup").iterdir()):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600


def test_a_run_refuses_a_state_folder_others_can_write() -> None:
    folder = state_dir() / "journal"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o1777)
    with pytest.raises(UnsafeFolder, match="writable by others"):
        Journal.create("run-shared")


# ------------------------------------------------------------- the context's checks, one by one


def _context(tmp_path: Path) -> UndoContext:
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    return UndoContext("run-ctx", (run,), tmp_path / "state")


def test_a_link_out_of_the_run_folder_is_refused(tmp_path: Path) -> None:
    context = _context(tmp_path)
    (tmp_path / "run" / "escape").symlink_to("/etc")
    assert context.path(str(tmp_path / "run" / "ckpt" / "new.pt")) == (
        tmp_path / "run" / "ckpt" / "new.pt")  # need not exist yet (a deleted file)
    with pytest.raises(UndoRefused, match="outside this run's folders"):
        context.path(str(tmp_path / "run" / "escape" / "passwd"))
    with pytest.raises(UndoRefused, match="absolute"):
        context.path("run/ckpt")


def test_a_pid_with_another_start_time_is_not_the_run_s_process(tmp_path: Path) -> None:
    context = _context(tmp_path)
    proc = _sleeper(AFTERSHOCK_RUN_ID="run-ctx")
    try:
        ref = _ref(proc)
        assert context.process(ref.to_json()) == ref
        # Same pid, another start: a reused pid. Nothing to undo on it, and nothing done.
        assert context.process({"pid": ref.pid, "start": ref.start - 1}) is None
        with pytest.raises(UndoRefused, match="does not name a process"):
            context.process({"pid": str(ref.pid), "start": ref.start})
        with pytest.raises(UndoRefused, match="never a process of a run"):
            context.process({"pid": 1, "start": 0})
    finally:
        proc.kill()
        proc.wait()


def test_names_and_cgroups_must_be_aftershock_s(tmp_path: Path) -> None:
    context = _context(tmp_path)
    assert context.name("aftershock_0123456789ab") == "aftershock_0123456789ab"
    for bad in ("not_ours", "aftershock_", "aftershock_x y", 7):
        with pytest.raises(UndoRefused):
            context.name(bad)
    mount = Path("/sys/fs/cgroup/cpu")
    good = {"cgroup": "/sys/fs/cgroup/cpu/a/aftershock_1", "home": "/sys/fs/cgroup/cpu/a",
            "root": "/sys/fs/cgroup/cpu"}
    assert context.cgroup(good, mount) == Path(good["cgroup"])
    for change in ({"root": "/sys/fs/cgroup/memory"}, {"home": "/sys/fs/cgroup/cpu"},
                   {"cgroup": "/sys/fs/cgroup/cpu/a/user.slice"},
                   {"cgroup": "/sys/fs/cgroup/cpu/a/../aftershock_1"}):
        with pytest.raises(UndoRefused):
            context.cgroup({**good, **change}, mount)
    with pytest.raises(UndoRefused, match="no such cgroup hierarchy"):
        context.cgroup(good, None)


def test_state_paths_are_under_a_token(tmp_path: Path) -> None:
    context = _context(tmp_path)
    base = tmp_path / "state" / "backup"
    assert context.state_path(str(base / "0123456789ab" / "f.pt"), "backup") == (
        "0123456789ab", "f.pt")
    with pytest.raises(UndoRefused, match="token"):
        context.state_path(str(base / "f.pt"), "backup")
    with pytest.raises(UndoRefused, match="state folder"):
        context.state_path(str(tmp_path / "state" / "storage" / "0123456789ab"), "backup")
