"""Samples the serving router's threads' CPU from inside the router process (scratch).

With ``PYTHONPATH=bench/results/profiles/router_threads`` and ``ROUTER_THREADS_OUT=DIR`` in
the environment of ``python -m bench.serving``, every router process (``--router-process``)
rewrites ``DIR/PID.json`` every 0.1 s: whether it journals, its total CPU since it started
(``os.times``), and the CPU of its threads by role, each thread counted at its last sample
(per-request HTTP threads that ended between two samples are only in the total).
``router_threads_show.py DIR`` pairs them. Nothing here runs unless both are set.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ROLES = {"journal-writer": "journal writer", "journal-fsync": "journal fsync", "streams": "streams",
         "supervisor": "supervisor", "http": "http accept", "MainThread": "main"}


def _cpu_s(tid: int | None) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(name: str) -> str:
    if name in ROLES:
        return ROLES[name]
    if name.startswith("link") and name.endswith(("-rx", "-tx")):
        return f"link {name[-2:]}"
    return "other"


def _sample(out: str) -> None:
    seen: dict[tuple[int | None, str], float] = {}
    journals = "--no-journal" not in sys.argv
    while True:
        for thread in threading.enumerate():
            if thread.name != "router-threads-sampler":
                cpu = _cpu_s(thread.native_id)
                if cpu is not None:
                    seen[(thread.native_id, thread.name)] = cpu
        roles: dict[str, float] = {}
        for (_, name), cpu in seen.items():
            roles[_role(name)] = roles.get(_role(name), 0.0) + cpu
        times = os.times()
        path = os.path.join(out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"journal": journals, "total_s": times.user + times.system,
                       "roles_s": roles}, f)
        os.replace(path + ".tmp", path)
        time.sleep(0.1)


_OUT = os.environ.get("ROUTER_THREADS_OUT")
if _OUT and "--router-process" in sys.argv:
    threading.Thread(target=_sample, args=(_OUT,), name="router-threads-sampler",
                     daemon=True).start()
