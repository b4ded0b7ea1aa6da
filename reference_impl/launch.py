"""torchrun, started warm: the reference trainer's ranks are forked from this launcher,
which has already imported torch and the trainer, instead of each starting a fresh
interpreter that imports them again (about 2-5 s of CPU per rank on a 2-core host, most of
a short run's wall time).

Usage: the arguments of ``python -m torch.distributed.run``, with the trainer given as
``-m aftershock.reference_impl.trainer``::

    python -m aftershock.reference_impl.launch --standalone --nproc-per-node=2 \\
        -m aftershock.reference_impl.trainer --replicas 2 --shards 1 --steps 100

It is torchrun itself (``torch.distributed.run.main``): the same agent, rendezvous, restarts
and log files, with ``--run-path --start-method=fork``, so each rank is a child of the
agent that runs ``aftershock/reference_impl/_rank.py``. Where the kernel does not let a
forked rank show its own environment in /proc (``_forked.supported``), or the program is
not the trainer, it runs torchrun unchanged: every rank a fresh interpreter.
"""

from __future__ import annotations

import logging
import os
import sys

from aftershock.reference_impl import _forked

TRAINER = ("-m", "aftershock.reference_impl.trainer")
#: What a launcher and its ranks import before anything runs: imported once by the warm
#: server a harness forks launchers from (harness/run/warm.py), and so by each fork.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "aftershock.reference_impl.trainer",
           "aftershock.reference_impl.resilient")
ENV_OFF = "AFTERSHOCK_FORK_RANKS"  # "0": start every rank as a fresh interpreter


def torchrun_argv(argv: list[str], *, fork: bool) -> list[str]:
    """torchrun's arguments: the trainer as a script torchrun forks where ``fork``."""
    for at in range(len(argv) - 1):
        if (argv[at], argv[at + 1]) in (TRAINER, ("--module", TRAINER[1])):
            if not fork:
                return list(argv)
            rank = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank.py")
            return [*argv[:at], "--run-path", "--start-method=fork", rank, *argv[at + 2:]]
    return list(argv)


def main() -> None:
    fork = os.environ.get(ENV_OFF, "1") != "0" and _forked.supported()
    argv = torchrun_argv(sys.argv[1:], fork=fork)
    if argv != sys.argv[1:]:
        # What every rank would import first: once here, shared by every fork.
        import torch._dynamo  # noqa: F401  (torch.use_deterministic_algorithms imports it)

        from aftershock.reference_impl import resilient, trainer  # noqa: F401
    from torch.distributed.run import main as torchrun

    sys.argv = [sys.argv[0], *argv]
    try:
        torchrun()
        code = 0
    except SystemExit as done:  # torchrun's failure: ChildFailedError, then exit 1
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    # torchrun's work is done (its workers ended, its store closed); what is left is the
    # interpreter's shutdown with torch loaded, about 1 s of a short run here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
