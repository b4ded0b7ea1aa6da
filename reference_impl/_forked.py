"""A rank that torchrun forked from the warm launcher (``aftershock.reference_impl.launch``)
instead of starting a fresh interpreter, and what it does to look and end like one.

Look: a forked process's /proc/PID/environ and /proc/PID/cmdline are its parent's (the
kernel shows the memory the process was exec'd with), so the rank's RANK, LOCAL_RANK and
run id would not be there, and the harness, which reads them as evidence of who a process
is, would not see a rank. The rank publishes the environment torchrun gave it and its own
command line instead (``prctl(PR_SET_MM, PR_SET_MM_MAP)``: the kernel's interface for a
process to say where they live; no privilege needed when the executable stays the same).

End: torchrun's forked workers report a return value before they exit; a rank that called
``os._exit(0)`` from inside would leave the launcher waiting for it forever. So the forked
rank returns 0 through torchrun's worker (which then exits without interpreter shutdown,
as ``os._exit`` would) and exits non-zero codes with ``os._exit``, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping, Sequence

PR_SET_MM = 35
PR_SET_MM_MAP = 14

#: The process torchrun forked, once it said so (``begin``); its own forks are not it.
_pid: int | None = None
#: The published blocks: the kernel points into them for as long as the process lives.
_published: tuple[ctypes.Array[ctypes.c_char], ...] = ()


class Exit(BaseException):
    """Raised by ``trainer._exit_now`` in a forked rank: the rank's code, to return through
    torchrun's worker. A BaseException, so no ``except Exception`` on the way stops it."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _MMMap(ctypes.Structure):
    """``struct prctl_mm_map`` (include/uapi/linux/prctl.h)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
        "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


def publish(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Make /proc/self/cmdline show ``argv`` and /proc/self/environ show ``env``; raises
    OSError where the kernel refuses (no CONFIG_CHECKPOINT_RESTORE, a seccomp filter)."""
    global _published
    with open("/proc/self/stat", encoding="ascii") as text:
        stat = text.read()
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 of proc(5)

    def field(number: int) -> int:
        return int(fields[number - 3])

    with open("/proc/self/auxv", "rb") as raw:
        auxv = raw.read()
    args = b"".join(os.fsencode(arg) + b"\0" for arg in argv)
    environ = b"".join(os.fsencode(f"{key}={value}") + b"\0" for key, value in env.items())
    blocks = tuple(ctypes.create_string_buffer(data, len(data)) for data in (args, environ, auxv))
    arg_at, env_at, auxv_at = (ctypes.addressof(block) for block in blocks)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_long]
    mm = _MMMap(field(26), field(27), field(45), field(46), field(47), libc.sbrk(0) or 0,
                field(28), arg_at, arg_at + len(args), env_at, env_at + len(environ),
                auxv_at, len(auxv), 0xFFFFFFFF)  # exe_fd -1: the executable stays
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_MM_MAP): {os.strerror(errno)}")
    _published = blocks


def supported() -> bool:
    """Whether a fork of this process can publish its environment: tried in a child, so
    nothing here changes."""
    pid = os.fork()
    if pid == 0:
        try:
            publish(["probe"], {"AFTERSHOCK_FORK_PROBE": "1"})
            with open("/proc/self/environ", "rb") as handle:
                ok = handle.read() == b"AFTERSHOCK_FORK_PROBE=1\0"
        except OSError:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def detach_inherited() -> list[int]:
    """Put /dev/null in place of what the rank inherited from the launcher and must not
    hold: the launcher's sockets (its rendezvous store: a fault that resets this rank's
    connections would reset the launcher's too) and its own stdout and stderr (the
    harness's pipes). A fresh interpreter holds none of them. Replaced, not closed: an
    object of the launcher's that closes its descriptor later closes /dev/null, never a
    descriptor the rank has opened since under the same number. The pipes torchrun's
    worker reports through stay. Returns the descriptors replaced."""
    launcher = set()
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            launcher.add(os.readlink(f"/proc/{os.getppid()}/fd/{fd}"))
    replaced = []
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd <= 2 or fd == null:
                continue
            try:
                what = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # the listing's own descriptor, closed since
            if what.startswith("socket:") or what in launcher:
                os.dup2(null, fd, inheritable=False)
                replaced.append(fd)
    finally:
        os.close(null)
    return replaced


def begin(argv: Sequence[str]) -> None:
    """In the rank torchrun just forked: publish what an exec'd rank would show, let go of
    the launcher's sockets and pipes, take the signal actions a fresh interpreter has (not
    the launcher's handlers), own ``sys.argv``."""
    global _pid
    _pid = os.getpid()
    publish(argv, os.environ)
    detach_inherited()
    sys.argv = [*argv[argv.index("-m") + 1:]] if "-m" in argv else list(argv)
    torch = sys.modules.get("torch")
    if torch is not None:  # a fresh interpreter seeds its default generator at random
        torch.seed()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def forked() -> bool:
    """Whether this process is the rank torchrun forked (not a fork of it)."""
    return _pid == os.getpid()
