"""Network faults on a process's real TCP connections: reset them, or cut it off from its peers.

Both act on the target's own sockets, found through its fd table and
/proc/PID/net/tcp{,6}, so traffic among the other processes is left alone.
A target in another network namespace (a rank in a node's container) is hit
in its own namespace: `ss` and `nft` run there (setns(2) before exec), and a
partition there drops the target's packets on every interface, not only
loopback, since its peers on other nodes are reached through the node's
network. Any other namespace is refused with FaultUnavailable.

There is no ``net.delay``: this kernel has no qdisc support (``tc qdisc add dev
lo root netem`` answers "Specified qdisc kind is unknown"), so latency is left
to the collective wrapper.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from aftershock.faults import _cgroup, _docker, _nft
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._netns import enter as _netns_enter
from aftershock.faults._proc import ProcessRef
from aftershock.faults._sockets import (
    CONNECTED,
    LISTEN,
    TcpSocket,
    same_netns,
    tcp_sockets,
    tcp_table,
)
from aftershock.faults.journal import Journal, UndoContext, UndoRefused, undone_on_error
from aftershock.faults.params import Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

# nft resolves `socket cgroupv2` paths relative to this folder (hard-coded in nftables).
_NFT_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _netns(target: ProcessRef) -> int | None:
    """None when the target shares the harness's network namespace; else a descriptor of
    the target's own (the caller closes it), if the target is in a container: a namespace
    the harness did not make otherwise is not its to touch."""
    if same_netns(target.pid):
        return None
    if _docker.container_of(target.pid) is None:
        raise FaultUnavailable(
            f"pid {target.pid} is in another network namespace that is not a container's; "
            "net faults reach the harness's own namespace and its nodes' containers"
        )
    return os.open(f"/proc/{target.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _in_netns(netns: int | None) -> dict[str, Any]:
    """subprocess arguments that run a tool inside ``netns`` (or here, for None)."""
    if netns is None:
        return {}
    return {"pass_fds": (netns,), "preexec_fn": functools.partial(_netns_enter, netns)}


def _ss_binary() -> str:
    candidates = (shutil.which("ss"), "/usr/bin/ss", "/bin/ss", "/usr/sbin/ss")
    found = next((p for p in candidates if p and os.access(p, os.X_OK)), None)
    if found is None:
        raise FaultUnavailable("ss not installed: apt-get install iproute2")
    return found


def _endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _selected(socks: Iterable[TcpSocket], port: int | None) -> list[TcpSocket]:
    return [
        s
        for s in socks
        if s.state in CONNECTED and (port is None or port in (s.local_port, s.remote_port))
    ]


class ResetParams(FaultParams):
    port: int | None = Field(None, ge=1, le=65535, description="only connections whose local "
                             "or remote port is this; default: every connection")


class Reset:
    params = ResetParams
    acts: Acts = "outside"
    needs = frozenset({"network"})
    info = KindInfo(
        kind="net.reset",
        summary="Reset the target's established TCP connections (the peer gets an RST).",
        caused_by="`ss -K` (SOCK_DESTROY through inet_diag) with a filter naming the exact "
        "4-tuple of each TCP connection the process holds (found through /proc/PID/fd and "
        "/proc/PID/net/tcp{,6}), run in the process's own network namespace (a node's "
        "container's, too); the process sees ECONNABORTED, its peer ECONNRESET. "
        "Needs CONFIG_INET_DIAG_DESTROY and CAP_NET_ADMIN.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        try:
            _ss_binary()
        except FaultUnavailable as exc:
            problems.append(str(exc))
        if not _capable(CAP_NET_ADMIN):
            problems.append("needs CAP_NET_ADMIN to destroy sockets (run as root)")
        return problems

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        netns = _netns(target)
        try:
            return self._reset(target, params, netns)
        finally:
            if netns is not None:
                os.close(netns)

    def _reset(self, target: ProcessRef, params: Mapping[str, Any], netns: int | None) -> Applied:
        port = ResetParams.bind(params).port
        socks = _selected(tcp_sockets(target.pid), port)
        if not target.alive():
            return Applied(self.info.kind, None, {}, f"pid {target.pid} already gone")
        if not socks:
            return Applied(self.info.kind, None, {}, f"pid {target.pid} has no TCP connection")
        expr = " or ".join(
            f"( src {_endpoint(s.local_ip, s.local_port)} "
            f"and dst {_endpoint(s.remote_ip, s.remote_port)} )"
            for s in socks
        )
        result = subprocess.run(
            [_ss_binary(), "-K", "-t", "-n", expr],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            **_in_netns(netns),
        )
        inodes = {s.inode for s in socks}
        left = [s for s in tcp_table(target.pid) if s.inode in inodes and s.state in CONNECTED]
        if result.returncode != 0 or len(left) == len(socks):
            raise FaultUnavailable(
                "ss -K did not destroy the connections (kernel needs CONFIG_INET_DIAG_DESTROY "
                f"and CAP_NET_ADMIN): rc={result.returncode} {result.stderr.strip()}"
            )
        detail = (
            f"reset {len(socks) - len(left)} of {len(socks)} TCP connections of pid {target.pid}"
        )
        return Applied(self.info.kind, None, {}, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


# Every socket the partitioned process holds is tagged with this fault's own mark
# (SO_MARK): the rules match the socket *object*, so a port or 4-tuple the target once
# used and then released is free again for anyone, at once. The high half says
# "aftershock", the low half tells concurrent partitions apart.
_MARK_BASE = 0x41530000
_SYS_PIDFD_GETFD = 438  # the same number on every architecture that has it (Linux 5.6)
CAP_NET_ADMIN = 12
CAP_SYS_PTRACE = 19


def _capable(cap: int) -> bool:
    """Whether this process holds capability ``cap`` (its effective set)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except OSError:
        pass
    return False


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    """A duplicate of descriptor ``fd`` of the process behind ``pidfd`` (pidfd_getfd(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    dup = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if dup < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return dup


def _getfd_works() -> bool:
    """pidfd_getfd exists here (tried on this process's own stdin)."""
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    try:
        os.close(_pidfd_getfd(pidfd, 0))
        return True
    except OSError as exc:
        return exc.errno not in (errno.ENOSYS, errno.EPERM)
    finally:
        os.close(pidfd)


def _tcp_fds(pid: int) -> dict[int, int]:
    """fd -> socket inode for every TCP socket in the fd table of ``pid``."""
    inodes = {s.inode for s in tcp_sockets(pid)}
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/{pid}/fd/{name}")
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    found[int(name)] = int(link[8:-1])
    return found


def _remark(target: ProcessRef, old: int | None, new: int) -> int:
    """Set SO_MARK ``new`` on each TCP socket of ``target`` whose mark is ``old`` (any if
    None) and not ``new`` already; the number of sockets changed. Each socket is reached
    through a duplicate of the target's own descriptor, closed at once: holding it would
    keep the socket alive after the target closed it."""
    changed: set[int] = set()
    pidfd = os.pidfd_open(target.pid)
    try:
        if not target.alive():  # the pidfd now pins the process the pid names
            return 0
        for fd, inode in _tcp_fds(target.pid).items():
            if inode in changed:
                continue
            try:
                dup = _pidfd_getfd(pidfd, fd)
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.ESRCH):
                    continue  # closed meanwhile
                raise
            sock = socket.socket(fileno=dup)
            try:
                if os.fstat(sock.fileno()).st_ino != inode:
                    continue  # the fd number was reused for another socket meanwhile
                now = sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK)
                if now != new and old in (None, now):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, new)
                    changed.add(inode)
            finally:
                sock.close()
    finally:
        os.close(pidfd)
    return len(changed)


def _ruleset(table: str, mark: int, cgroup: tuple[str, int] | None, *, lo_only: bool = True
             ) -> str:
    """Drop rules for the sockets tagged ``mark`` and, if ``cgroup`` is (path, level), for
    every socket created in that group later; on loopback only (the harness's namespace,
    where every peer is local) or, ``lo_only`` False, on every interface (a node's)."""
    text = f"table inet {table} {{\n"
    for chain, hook, dev in (("out", "output", "oifname"), ("in", "input", "iifname")):
        where = f'{dev} "lo" ' if lo_only else ""
        text += f"  chain {chain} {{\n    type filter hook {hook} priority -10; policy accept;\n"
        # On output the packet carries its socket's mark; on input the socket it is
        # delivered to is looked up: a listener's mark drops every new connection to it,
        # and the sockets it accepts inherit the mark.
        which = "meta mark" if hook == "output" else "socket mark"
        text += f"    {where}{which} {mark:#x} drop\n"
        if cgroup is not None:
            # Sockets created after the cut carry the target's cgroup. On output the
            # packet's own socket is checked; on input the socket it is delivered to.
            path, level = cgroup
            text += f'    {where}socket cgroupv2 level {level} "{path}" drop\n'
        text += "  }\n"
    return text + "}\n"


def _delete_in_container(container: str, table: str, owner: ProcessRef | None) -> None:
    """Delete ``table`` from the network namespace of ``container``, reached through the
    fault's target if it lives, else any live process of the container; none left means
    the container stopped and its namespace, table included, is gone."""
    pid = owner.pid if owner is not None and owner.alive() else _docker.member(container)
    if pid is None:
        return
    try:
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # ended meanwhile
    try:
        if _docker.container_of(pid) == container:  # still that container's process
            _nft.delete_table(table, netns=netns)
    finally:
        os.close(netns)


def _mark_all(target: ProcessRef, mark: int) -> int:
    """Mark every socket of ``target`` with ``mark``; how many were marked."""
    try:
        # Again until nothing new: a connection accepted by a listener before it was
        # marked is a socket the first pass did not see.
        marked = 0
        for _ in range(3):
            added = _remark(target, None, mark) if target.alive() else 0
            marked += added
            if not added:
                break
    except OSError as exc:
        raise FaultUnavailable(
            f"cannot mark the sockets of pid {target.pid} ({exc.strerror}): "
            "needs pidfd_getfd (Linux 5.6) and CAP_SYS_PTRACE and CAP_NET_ADMIN"
        ) from exc
    return marked


class PartitionParams(FaultParams):
    duration: Duration | None = Field(None, description="heal after this long; default: at "
                                      "the end of the run")
    new_connections: bool = Field(
        True, description="also cut sockets the process opens after the cut, through a "
        "cgroup v2 group (needs a cgroup2 mount under /sys/fs/cgroup)")


class Partition:
    params = PartitionParams
    acts: Acts = "outside"
    needs = frozenset({"network"})
    info = KindInfo(
        kind="net.partition",
        summary="Cut the target off from its peers over loopback, both ways; others unaffected.",
        caused_by="An nftables table `inet aftershock_<id>` with drop rules on the output and "
        "input hooks of `lo` for the sockets the process holds, each tagged with the fault's "
        "own SO_MARK through pidfd_getfd(2) (a listener's mark passes to the connections it "
        "accepts), and (new_connections) every socket it creates later, matched with "
        "`socket cgroupv2` after moving the process into its own cgroup v2 group. Rules "
        "match socket objects, never port numbers: a port the target released is free for "
        "others at once. Packets are dropped silently, so peers see timeouts, not resets. "
        "For a process in a node's container the table goes into the container's network "
        "namespace and drops its sockets' packets on every interface, not only loopback. "
        "Needs nftables, CAP_NET_ADMIN and CAP_SYS_PTRACE.",
        reverted_by="`nft delete table inet aftershock_<id>`; the marks are cleared from the "
        "process's sockets that still carry them; the process is moved back to its cgroup v2 "
        "group and the fault's group removed. Established connections resume on TCP's next "
        "retransmission.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        try:
            _nft.nft_binary()
        except FaultUnavailable as exc:
            problems.append(str(exc))
        if not _capable(CAP_NET_ADMIN):
            problems.append("needs CAP_NET_ADMIN to load nftables rules and mark sockets "
                            "(run as root)")
        if not _capable(CAP_SYS_PTRACE) or not _getfd_works():
            problems.append("needs pidfd_getfd (Linux 5.6 or later) and CAP_SYS_PTRACE to "
                            "reach the target's sockets (run as root)")
        mount = _cgroup.v2_mount()
        if PartitionParams.bind(params).new_connections and (
                mount is None or not mount.is_relative_to(_NFT_CGROUP_ROOT)):
            problems.append("new_connections needs a cgroup2 mount under /sys/fs/cgroup "
                            "(or set new_connections: false to cut only existing sockets)")
        return problems

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        _nft.nft_binary()
        netns = _netns(target)
        try:
            return self._partition(target, params, journal, netns)
        finally:
            if netns is not None:
                os.close(netns)

    def _partition(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal,
                   netns: int | None) -> Applied:
        token = uuid.uuid4().hex[:12]
        table = f"{_nft.TABLE_PREFIX}{token}"
        mark = _MARK_BASE | int(token[:4], 16)
        undo: dict[str, Any] = {"table": table, "mark": mark, **target.to_json()}
        if netns is not None:
            # The table lives in the node's namespace: revert finds it again through any
            # process of the same container, even once the target is gone.
            undo.update({"container": _docker.container_of(target.pid), "run": journal.run_id})
        cgroup: tuple[str, int] | None = None
        group_dir: Path | None = None
        mount = _cgroup.v2_mount()
        if PartitionParams.bind(params).new_connections:
            home = _cgroup.group_of(target.pid, None)
            if mount is None or home is None or not mount.is_relative_to(_NFT_CGROUP_ROOT):
                raise FaultUnavailable(
                    "net.partition with new_connections needs a cgroup2 mount under "
                    "/sys/fs/cgroup (set new_connections: false to cut only existing sockets)"
                )
            # Inside the target's own group: the run's group, when the harness made one.
            group = f"{home.rstrip('/')}/aftershock_{token}"
            group_dir = _cgroup.directory(mount, group)
            level = len([part for part in group.split("/") if part])
            cgroup = (str(group_dir.relative_to(_NFT_CGROUP_ROOT)), level)
            undo.update(
                {
                    "cgroup": str(group_dir),
                    "home": str(_cgroup.directory(mount, home)),
                    "root": str(mount),
                }
            )
        entry = journal.intend(self.info.kind, undo)
        with undone_on_error(journal, entry, self.revert, undo):
            if group_dir is not None:
                group_dir.mkdir()
                # Move first, then mark: a socket made in between is caught by the cgroup
                # rule instead of being missed by the marks.
                _cgroup.move(target.pid, group_dir)
            marked = _mark_all(target, mark)
            socks = tcp_sockets(target.pid)
            _nft.load(_ruleset(table, mark, cgroup, lo_only=netns is None), netns=netns)
        listening = sorted({s.local_port for s in socks if s.state == LISTEN})
        connected = sum(1 for s in socks if s.state in CONNECTED)
        detail = (
            f"pid {target.pid} partitioned ({table}, mark {mark:#x} on {marked} sockets): "
            f"{connected} connections, listening ports {listening}"
            + (", new sockets by cgroup" if cgroup else ", existing sockets only")
        )
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        owner = ProcessRef(int(undo["pid"]), int(undo["start"])) if undo.get("pid") else None
        if undo.get("container"):
            _delete_in_container(str(undo["container"]), str(undo["table"]), owner)
        else:
            _nft.delete_table(str(undo["table"]))
        if undo.get("mark") is not None and owner is not None:
            # A listener that kept the mark would pass it on to every connection it
            # accepts from now on; harmless without the table, but not ours to leave.
            with contextlib.suppress(OSError):
                if owner.alive():
                    _remark(owner, int(undo["mark"]), 0)
        if undo.get("cgroup"):
            _cgroup.remove(Path(undo["cgroup"]), Path(undo["home"]), Path(undo["root"]))

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        table = context.name(undo.get("table"))
        if undo.get("container") is not None:
            _docker.validate_container(undo, context)
        if undo.get("cgroup"):
            group = context.cgroup(undo, _cgroup.v2_mount())
            if group.name != table:
                raise UndoRefused(f"cgroup {group} is not the group of table {table}")


RESET = register(Reset())
PARTITION = register(Partition())
