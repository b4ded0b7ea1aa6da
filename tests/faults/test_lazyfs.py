"""The lazy filesystem behind storage.lose_unsynced: it keeps exactly what POSIX promises.

Two layers: the model (``LazyTree``, no FUSE: fast, and a property test over random
sequences of operations), then the same promises through a real FUSE mount and real system
calls. The folder below the mount is the oracle for "durable": after a loss the mount must
show exactly what is there, and what is there must be what was fsynced.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aftershock.faults import lazyfs
from aftershock.faults._inotify import FileWatch
from aftershock.faults.lazyfs import LazyTree, Node

# ------------------------------------------------------------------------------ the model


def snapshot(tree: LazyTree, node: Node | None = None, prefix: str = "") -> dict[str, bytes]:
    """The current view as {path: content}, folders as b'<dir>'."""
    node = node or tree.root
    found: dict[str, bytes] = {}
    for name, child in node.entries.items():
        path = f"{prefix}{name}"
        if child.is_dir:
            found[path] = b"<dir>"
            found.update(snapshot(tree, child, path + "/"))
        else:
            found[path] = bytes(child.content)
    return found


def on_disk(folder: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        found[rel] = b"<dir>" if path.is_dir() else path.read_bytes()
    return found


@pytest.fixture
def tree(tmp_path: Path) -> LazyTree:
    below = tmp_path / "disk"
    below.mkdir()
    return LazyTree(below)


def put(tree: LazyTree, path: str, data: bytes) -> Node:
    node = tree.create(path, 0o644)
    tree.write(node, data, 0)
    return node


def test_data_written_without_fsync_is_lost(tree: LazyTree) -> None:
    node = put(tree, "/a", b"hello")
    tree.fsyncdir(tree.root)  # the name is durable, the data is not
    loss = tree.lose()
    assert snapshot(tree) == {"a": b""}  # the zero-length file of a real crash
    assert (loss.files, loss.bytes, loss.entries) == (1, 5, 0)
    tree.write(node, b"again", 0)
    tree.fsync(node)
    tree.lose()
    assert snapshot(tree) == {"a": b"again"}
    assert on_disk(tree.below) == {"a": b"again"}


def test_a_new_name_needs_its_folder_fsynced(tree: LazyTree) -> None:
    node = put(tree, "/a", b"data")
    tree.fsync(node)  # the data is durable, the name is not
    assert on_disk(tree.below) == {}
    tree.lose()
    assert snapshot(tree) == {}


def test_rename_without_folder_fsync_is_undone(tree: LazyTree) -> None:
    tmp = put(tree, "/.a.tmp", b"new")
    tree.fsync(tmp)
    tree.fsyncdir(tree.root)
    tree.rename("/.a.tmp", "/a")
    assert snapshot(tree) == {"a": b"new"}
    loss = tree.lose()
    assert snapshot(tree) == {".a.tmp": b"new"}
    assert loss.entries == 2  # the new name, and the old one it took away
    tree.rename("/.a.tmp", "/a")
    tree.fsyncdir(tree.root)
    tree.lose()
    assert snapshot(tree) == on_disk(tree.below) == {"a": b"new"}


def test_rename_over_a_durable_file_keeps_the_old_one_until_the_folder_is_fsynced(
    tree: LazyTree,
) -> None:
    old = put(tree, "/ckpt", b"old")
    tree.fsync(old)
    tree.fsyncdir(tree.root)
    new = put(tree, "/ckpt.tmp", b"new")
    tree.fsync(new)
    tree.rename("/ckpt.tmp", "/ckpt")
    tree.lose()
    assert snapshot(tree) == {"ckpt": b"old"}


def test_a_folder_needs_its_own_fsync_and_its_parents(tree: LazyTree) -> None:
    tree.mkdir("/step_1", 0o755)
    node = put(tree, "/step_1/rank_0.pt", b"payload")
    tree.fsync(node)
    tree.fsyncdir(tree.lookup("/step_1"))  # its entries are durable, its own name is not
    tree.lose()
    assert snapshot(tree) == {}
    tree.mkdir("/step_1", 0o755)
    tree.fsyncdir(tree.root)  # now the name is, but not what is in it
    put(tree, "/step_1/rank_0.pt", b"payload")
    tree.lose()
    assert snapshot(tree) == {"step_1": b"<dir>"}


def test_unlink_and_truncate_come_back_without_fsync(tree: LazyTree) -> None:
    node = put(tree, "/keep", b"123456")
    tree.fsync(node)
    tree.fsyncdir(tree.root)
    tree.truncate(node, 2)
    assert snapshot(tree) == {"keep": b"12"}
    tree.unlink("/keep")
    tree.lose()
    assert snapshot(tree) == {"keep": b"123456"}


def test_existing_files_are_durable_and_the_disk_follows_every_fsync(tmp_path: Path) -> None:
    below = tmp_path / "disk"
    (below / "step_1").mkdir(parents=True)
    (below / "step_1" / "COMMIT").write_text("1")
    (below / "latest").symlink_to("step_1")
    tree = LazyTree(below)
    assert snapshot(tree) == {"step_1": b"<dir>", "step_1/COMMIT": b"1", "latest": b"step_1"}
    tree.rename("/step_1", "/step_2")
    tree.unlink("/latest")
    tree.symlink("/latest", "step_2")
    tree.fsyncdir(tree.root)
    assert sorted(p.name for p in below.iterdir()) == ["latest", "step_2"]
    assert (below / "step_2" / "COMMIT").read_text() == "1"
    assert os.readlink(below / "latest") == "step_2"
    tree.lose()
    assert snapshot(tree) == {"step_2": b"<dir>", "step_2/COMMIT": b"1", "latest": b"step_2"}


def test_namespace_errors_are_posix_errors(tree: LazyTree) -> None:
    put(tree, "/f", b"x")
    tree.mkdir("/d", 0o755)
    put(tree, "/d/g", b"y")
    cases = [
        (lambda: tree.create("/f", 0o644), errno.EEXIST),
        (lambda: tree.lookup("/nope"), errno.ENOENT),
        (lambda: tree.lookup("/f/x"), errno.ENOTDIR),
        (lambda: tree.rmdir("/d"), errno.ENOTEMPTY),
        (lambda: tree.unlink("/d"), errno.EISDIR),
        (lambda: tree.rename("/d", "/d/sub"), errno.EINVAL),
        (lambda: tree.rename("/f", "/d"), errno.EISDIR),
        (lambda: tree.rename("/f", "/d/g", flags=1), errno.EEXIST),  # RENAME_NOREPLACE
    ]
    for call, code in cases:
        with pytest.raises(OSError, match=os.strerror(code)) as info:
            call()
        assert info.value.errno == code


NAMES = st.sampled_from(["a", "b", "c"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), NAMES, NAMES, st.binary(max_size=8)),
        st.tuples(st.just("fsync"), NAMES, NAMES),
        st.tuples(st.just("fsyncdir"), NAMES),
        st.tuples(st.just("rename"), NAMES, NAMES, NAMES, NAMES),
        st.tuples(st.just("unlink"), NAMES, NAMES),
        st.tuples(st.just("mkdir"), NAMES),
        st.tuples(st.just("lose")),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_after_any_loss_the_view_is_the_disk(tmp_path: Path, ops: list[tuple[object, ...]]) -> None:
    """Random operations on two folder levels: whatever happened, right after a loss the
    mount shows exactly what the folder below holds, and so does a fresh mount of it."""
    below = tmp_path / "disk"
    shutil.rmtree(below, ignore_errors=True)
    below.mkdir()
    tree = LazyTree(below)
    for op in [*ops, ("lose",)]:
        try:
            match op:
                case ("put", d, f, data):
                    node = tree.lookup(f"/{d}/{f}") if f"{d}/{f}" in snapshot(tree) else \
                        tree.create(f"/{d}/{f}", 0o644)
                    tree.write(node, bytes(data), 0)  # type: ignore[arg-type]
                case ("fsync", d, f):
                    tree.fsync(tree.lookup(f"/{d}/{f}"))
                case ("fsyncdir", d):
                    tree.fsyncdir(tree.lookup("/" if d == "a" else f"/{d}"))
                case ("rename", d1, f1, d2, f2):
                    tree.rename(f"/{d1}/{f1}", f"/{d2}/{f2}")
                case ("unlink", d, f):
                    tree.unlink(f"/{d}/{f}")
                case ("mkdir", d):
                    tree.mkdir(f"/{d}", 0o755)
                case ("lose",):
                    tree.lose()
                    assert snapshot(tree) == on_disk(below)
                    assert snapshot(LazyTree(below)) == on_disk(below)
        except OSError:
            pass  # ENOENT, EEXIST...: the operation did nothing, as on a real filesystem


# ------------------------------------------------------------------------ a real mount


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def power_loss(name: str) -> None:
    lazyfs.command(name, "lose")
    lazyfs.command(name, "on")


@pytest.mark.timeout(60)
def test_a_mount_loses_what_was_not_fsynced(mount: tuple[Path, str]) -> None:
    folder, name = mount
    write(folder / "synced", b"kept", sync=True)
    write(folder / "named_only", b"lost", sync=False)
    fsync_path(folder)  # both names are durable now
    write(folder / "unnamed", b"data", sync=True)  # its name never is
    write(folder / "synced", b"overwritten", sync=False)
    (folder / "sub").mkdir()
    write(folder / "sub" / "f", b"x", sync=True)
    fsync_path(folder / "sub")  # sub's own name in folder is not durable
    assert lazyfs.command(name, "unsynced")["files"] == 4
    power_loss(name)
    assert sorted(os.listdir(folder)) == ["named_only", "synced"]
    assert (folder / "synced").read_bytes() == b"kept"
    assert (folder / "named_only").read_bytes() == b""


@pytest.mark.timeout(60)
def test_each_fsync_is_remembered_with_when_it_returned_and_what_it_made_durable(
        mount: tuple[Path, str]) -> None:
    """What acknowledged_durable times a server's tokens against (storage.sync_history): an
    fsync that made something durable, with the monotonic time it returned; one with nothing
    new changes nothing."""
    from aftershock.faults import storage
    from aftershock.faults.registry import Applied

    folder, name = mount
    began = time.monotonic()
    fd = os.open(folder / "journal.wal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"one\n")
        os.fsync(fd)
        between = time.monotonic()
        os.fsync(fd)  # nothing new
        os.write(fd, b"two\n")
        os.fsync(fd)
        os.write(fd, b"three\n")  # never fsynced
    finally:
        os.close(fd)
    ended = time.monotonic()
    syncs = lazyfs.command(name, "syncs journal.wal")
    assert [size for _, size in syncs["syncs"]] == [4, 8]
    (first, _), (second, _) = syncs["syncs"]
    assert began < first < between < second < ended  # the harness's own clock
    assert syncs["complete"]
    with pytest.raises(RuntimeError, match="syncs nope"):
        lazyfs.command(name, "syncs nope")
    prepared = Applied("storage.lose_unsynced", None, {"mount": str(folder), "source": name}, "")
    assert storage.sync_history(prepared, folder / "journal.wal") == {
        "syncs": syncs["syncs"], "complete": True}
    assert storage.sync_history(prepared, folder.parent / "elsewhere.wal") is None
    assert storage.sync_history(prepared, folder) is None
    other = Applied("storage.corrupt", None, {"mount": str(folder), "source": name}, "")
    assert storage.sync_history(other, folder / "journal.wal") is None


@pytest.mark.usefixtures("fuse")
@pytest.mark.timeout(60)
def test_an_atomic_writer_survives_and_the_folder_below_keeps_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with lazyfs.mounted(folder) as name:
        (folder / "step_1").mkdir()
        fsync_path(folder)
        write(folder / "step_1" / ".COMMIT.tmp", b"1", sync=True)
        os.replace(folder / "step_1" / ".COMMIT.tmp", folder / "step_1" / "COMMIT")
        fsync_path(folder / "step_1")
        write(folder / "step_1" / ".late.tmp", b"2", sync=True)
        os.replace(folder / "step_1" / ".late.tmp", folder / "step_1" / "late")  # no dir fsync
        power_loss(name)
        assert sorted(os.listdir(folder / "step_1")) == ["COMMIT"]
        assert (folder / "step_1" / "COMMIT").read_bytes() == b"1"
    # Unmounted: the folder itself holds what survived, nothing of ours besides.
    assert on_disk(folder) == {"step_1": b"<dir>", "step_1/COMMIT": b"1"}


@pytest.mark.timeout(60)
def test_o_sync_and_fdatasync_make_data_durable(mount: tuple[Path, str]) -> None:
    folder, name = mount
    fd = os.open(folder / "log", os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o644)
    os.write(fd, b"one ")
    os.close(fd)
    fd = os.open(folder / "data", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"two")
    os.fdatasync(fd)
    os.close(fd)
    fsync_path(folder)
    power_loss(name)
    assert (folder / "log").read_bytes() == b"one "
    assert (folder / "data").read_bytes() == b"two"


@pytest.mark.timeout(60)
def test_an_open_file_keeps_its_data_across_rename_and_unlink(mount: tuple[Path, str]) -> None:
    folder, _ = mount
    with open(folder / "a", "wb") as handle:
        handle.write(b"first ")
        handle.flush()
        os.rename(folder / "a", folder / "b")
        handle.write(b"second")
        handle.flush()
        handle.truncate(9)
    assert (folder / "b").read_bytes() == b"first sec"
    with open(folder / "b", "rb") as handle:
        os.unlink(folder / "b")
        assert handle.read() == b"first sec"
    assert os.listdir(folder) == []


@pytest.mark.timeout(60)
def test_powered_off_every_request_fails_until_power_is_back(mount: tuple[Path, str]) -> None:
    folder, name = mount
    write(folder / "f", b"x", sync=False)
    lazyfs.command(name, "lose")
    with pytest.raises(OSError, match="Input/output error") as info:
        os.listdir(folder)
    assert info.value.errno == errno.EIO
    lazyfs.command(name, "on")
    assert os.listdir(folder) == []


@pytest.mark.timeout(60)
def test_inotify_sees_the_jobs_operations_on_the_mount(mount: tuple[Path, str]) -> None:
    folder, _ = mount
    with FileWatch(folder, "step_*/COMMIT", "created") as watch:
        (folder / "step_1").mkdir()
        write(folder / "step_1" / ".COMMIT.tmp", b"1", sync=True)
        os.replace(folder / "step_1" / ".COMMIT.tmp", folder / "step_1" / "COMMIT")
        deadline = time.monotonic() + 5
        while not watch.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.hits == ["step_1/COMMIT"]


@pytest.mark.timeout(60)
def test_inotify_counts_each_file_once_in_folders_made_at_once(
    mount: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job writes into its new folder right after the harness adds the folder's watch and
    before it scans it: the file is then seen twice, by the scan and by its own event, and
    must count once, although FUSE's readdir reports no inode numbers."""
    folder, _ = mount
    add = FileWatch._add

    def job_writes_meanwhile(self: FileWatch, path: Path, mask: int) -> int | None:
        wd = add(self, path, mask)
        if path.name.startswith("step_"):
            write(path / "rank_0.pt", b"x", sync=False)
        return wd

    monkeypatch.setattr(FileWatch, "_add", job_writes_meanwhile)
    with FileWatch(folder, "step_*/rank_0.pt", "created") as watch:
        (folder / "step_1").mkdir()
        deadline = time.monotonic() + 5
        while not watch.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        watch.poll()
        assert watch.hits == ["step_1/rank_0.pt"]


@pytest.mark.usefixtures("fuse")
@pytest.mark.timeout(60)
def test_the_server_unmounts_itself_when_its_harness_goes(tmp_path: Path) -> None:
    """The harness holds the server's stdin: if the harness dies, the server takes its mount
    away by itself (the reaper and `aftershock heal` would too, from the journal)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    name = lazyfs.SOURCE_PREFIX + "orphan" + os.urandom(3).hex()
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from aftershock.faults import lazyfs\n"
         f"p = lazyfs.launch(Path({str(folder)!r}), {name!r})\n"
         f"lazyfs.mount_now(p, Path({str(folder)!r}), {name!r})\n"
         "print(p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        assert lazyfs.mounted_source(folder) == name
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 10
    while lazyfs.mounted_source(folder) == name and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert lazyfs.mounted_source(folder) is None
        while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{server}") or "Z" in Path(
            f"/proc/{server}/stat").read_text().split(")")[1][:3]
    finally:
        lazyfs.unmount(folder, name)


@pytest.mark.usefixtures("fuse")
@pytest.mark.timeout(60)
def test_a_launched_server_that_is_never_told_to_mount_goes_away(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    proc = lazyfs.launch(folder, lazyfs.SOURCE_PREFIX + "never")
    lazyfs.close(proc)
    assert proc.returncode == 0
    assert lazyfs.mounted_source(folder) is None
