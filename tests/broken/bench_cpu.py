"""Deliberately broken: a process's CPU time read *with* its waited-for children's
(utime + stime + cutime + cstime), which bench.harness_overhead must not charge to the CLI
(tests/test_bench_unit.py shows its check catches this)."""

from __future__ import annotations

import os
from pathlib import Path


def own_cpu_s_with_children(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
