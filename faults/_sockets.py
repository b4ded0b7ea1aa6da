"""A process's TCP sockets, read from /proc: its fd table joined with /proc/PID/net/tcp{,6}."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

# Kernel TCP states, as the hex "st" column of /proc/net/tcp writes them.
ESTABLISHED = 0x01
SYN_SENT = 0x02
SYN_RECV = 0x03
FIN_WAIT1 = 0x04
FIN_WAIT2 = 0x05
CLOSE_WAIT = 0x08
LAST_ACK = 0x09
LISTEN = 0x0A
CONNECTED = frozenset({ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK})


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One TCP socket. IPv4-mapped IPv6 addresses are written as plain IPv4."""

    local_ip: str
    local_port: int
    remote_ip: str
    remote_port: int
    state: int
    inode: int

    @property
    def version(self) -> int:
        return ipaddress.ip_address(self.local_ip).version

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.local_ip).is_loopback


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # The kernel prints each 32-bit word in host byte order (little-endian on x86/arm).
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    if len(packed) == 4:
        ip = socket.inet_ntop(socket.AF_INET, packed)
    else:
        addr = ipaddress.IPv6Address(packed)
        ip = str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)
    return ip, int(port_hex, 16)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets in the fd table of ``pid`` (shared by all its threads)."""
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue  # closed while we looked
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def tcp_table(pid: int | str = "self") -> list[TcpSocket]:
    """Every TCP socket in the network namespace of ``pid``."""
    found: list[TcpSocket] = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            local_ip, local_port = _address(cols[1])
            remote_ip, remote_port = _address(cols[2])
            found.append(
                TcpSocket(
                    local_ip, local_port, remote_ip, remote_port, int(cols[3], 16), int(cols[9])
                )
            )
    return found


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """The TCP sockets that process ``pid`` holds open."""
    inodes = socket_inodes(pid)
    return [sock for sock in tcp_table(pid) if sock.inode in inodes and sock.inode != 0]


def same_netns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False
