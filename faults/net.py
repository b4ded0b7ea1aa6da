"""Network faults on a process's real TCP connections: reset them, or cut it off from its peers.

Both act on the target's own sockets, found through its fd table and
/proc/PID/net/tcp{,6}, so traffic among the other processes is left alone.
Only the host's network namespace is supported (a target in another one,
e.g. in a container, is refused with FaultUnavailable).

There is no ``net.delay``: this kernel has no qdisc support (``tc qdisc add dev
lo root netem`` answers "Specified qdisc kind is unknown"), so latency is left
to the collective wrapper.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from faults import _cgroup, _nft
from faults._errors import FaultUnavailable
from faults._proc import ProcessRef
from faults._sockets import CONNECTED, LISTEN, TcpSocket, same_netns, tcp_sockets, tcp_table
from faults.journal import Journal, UndoContext, UndoRefused, undone_on_error
from faults.registry import Applied, KindInfo, register

# nft resolves `socket cgroupv2` paths relative to this folder (hard-coded in nftables).
_NFT_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _check_netns(target: ProcessRef) -> None:
    if not same_netns(target.pid):
        raise FaultUnavailable(
            f"pid {target.pid} is in another network namespace; net faults support only "
            "processes in the harness's own namespace"
        )


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


class Reset:
    info = KindInfo(
        kind="net.reset",
        summary="Reset the target's established TCP connections (the peer gets an RST).",
        caused_by="`ss -K` (SOCK_DESTROY through inet_diag) with a filter naming the exact "
        "4-tuple of each TCP connection the process holds (found through /proc/PID/fd and "
        "/proc/PID/net/tcp{,6}); the process sees ECONNABORTED, its peer ECONNRESET. "
        "Needs CONFIG_INET_DIAG_DESTROY and CAP_NET_ADMIN.",
        params={
            "port": "reset only connections whose local or remote port is this; default all",
        },
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        _check_netns(target)
        port = int(params["port"]) if params.get("port") is not None else None
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


def _set(name: str, kind: str, elements: list[str]) -> str:
    body = f"type {kind};"
    if elements:
        body += " elements = { " + ", ".join(elements) + " };"
    return f"  set {name} {{ {body} }}\n"


def _ruleset(table: str, socks: list[TcpSocket], cgroup: tuple[str, int] | None) -> str:
    """Drop rules for the target's current sockets (by 4-tuple and listening port) and,
    if ``cgroup`` is (path, level), for every socket it creates later."""
    conns4: set[str] = set()
    conns6: set[str] = set()
    listen: set[str] = set()
    for s in socks:
        if s.state == LISTEN:
            listen.add(str(s.local_port))
        elif s.state in CONNECTED:
            both = (
                f"{s.local_ip} . {s.local_port} . {s.remote_ip} . {s.remote_port}",
                f"{s.remote_ip} . {s.remote_port} . {s.local_ip} . {s.local_port}",
            )
            (conns4 if s.version == 4 else conns6).update(both)
    text = f"table inet {table} {{\n"
    text += _set("conns4", "ipv4_addr . inet_service . ipv4_addr . inet_service", sorted(conns4))
    text += _set("conns6", "ipv6_addr . inet_service . ipv6_addr . inet_service", sorted(conns6))
    text += _set("listen", "inet_service", sorted(listen))
    for chain, hook, dev in (("out", "output", "oifname"), ("in", "input", "iifname")):
        text += f"  chain {chain} {{\n    type filter hook {hook} priority -10; policy accept;\n"
        text += f'    {dev} "lo" ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop\n'
        text += f'    {dev} "lo" ip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop\n'
        # Connections to the target's listeners, and the target's answers on accepted ones.
        text += f'    {dev} "lo" tcp dport @listen drop\n'
        text += f'    {dev} "lo" tcp sport @listen drop\n'
        if cgroup is not None:
            # Sockets created after the cut carry the target's cgroup. On output the
            # packet's own socket is checked; on input the socket it is delivered to.
            path, level = cgroup
            text += f'    {dev} "lo" socket cgroupv2 level {level} "{path}" drop\n'
        text += "  }\n"
    return text + "}\n"


class Partition:
    info = KindInfo(
        kind="net.partition",
        summary="Cut the target off from its peers over loopback, both ways; others unaffected.",
        caused_by="An nftables table `inet aftershock_<id>` with drop rules on the output and "
        "input hooks of `lo`: the exact 4-tuples of the process's TCP connections, its "
        "listening ports, and (new_connections) every socket it creates later, matched with "
        "`socket cgroupv2` after moving the process into its own cgroup v2 group. Packets are "
        "dropped silently, so peers see timeouts, not resets.",
        params={
            "new_connections": "also cut sockets the process opens after the cut, through a "
            "cgroup v2 group; default true (needs a cgroup2 mount under /sys/fs/cgroup)",
        },
        reverted_by="`nft delete table inet aftershock_<id>`; the process is moved back to "
        "its cgroup v2 group and the fault's group removed. Established connections resume "
        "on TCP's next retransmission.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        _check_netns(target)
        _nft.nft_binary()
        token = uuid.uuid4().hex[:12]
        table = f"{_nft.TABLE_PREFIX}{token}"
        undo: dict[str, Any] = {"table": table}
        cgroup: tuple[str, int] | None = None
        group_dir: Path | None = None
        mount = _cgroup.v2_mount()
        if params.get("new_connections", True):
            home = _cgroup.group_of(target.pid, None)
            if mount is None or home is None or not mount.is_relative_to(_NFT_CGROUP_ROOT):
                raise FaultUnavailable(
                    "net.partition with new_connections needs a cgroup2 mount under "
                    "/sys/fs/cgroup (set new_connections: false to cut only existing sockets)"
                )
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
                # Move first, then read the sockets: a socket made in between is caught
                # by the cgroup rule instead of being missed by the port rules.
                _cgroup.move(target.pid, group_dir)
            socks = tcp_sockets(target.pid)
            _nft.load(_ruleset(table, socks, cgroup))
        listening = sorted({s.local_port for s in socks if s.state == LISTEN})
        connected = sum(1 for s in socks if s.state in CONNECTED)
        detail = (
            f"pid {target.pid} partitioned ({table}): {connected} connections, "
            f"listening ports {listening}"
            + (", new sockets by cgroup" if cgroup else ", existing sockets only")
        )
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        _nft.delete_table(str(undo["table"]))
        if undo.get("cgroup"):
            _cgroup.remove(Path(undo["cgroup"]), Path(undo["home"]), Path(undo["root"]))

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        table = context.name(undo.get("table"))
        if undo.get("cgroup"):
            group = context.cgroup(undo, _cgroup.v2_mount())
            if group.name != table:
                raise UndoRefused(f"cgroup {group} is not the group of table {table}")


RESET = register(Reset())
PARTITION = register(Partition())
