"""When a few noisy repetitions prove a target: a distribution-free interval for their median.

On a shared 2-core host neighbouring runs of the same code differ by several percent, so a
median under a limit proves nothing unless the repetitions agree. The benches
(``bench.run``, ``bench.serving``, ``bench.harness_overhead``) call a target met only when
this interval is within its limit, not met only when it is beyond it, and otherwise say
"not resolved".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# A target is met only when an interval for the median at this confidence lies within its
# limit; with fewer repetitions than that takes (5), every repetition must, and 3 at least.
CONFIDENCE = 0.90
MIN_REPEATS = 3


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``, and its coverage: the
    narrowest pair of order statistics ``(x_(k), x_(n+1-k))`` that covers the median with
    probability ``1 - 2 P(Binomial(n, 1/2) < k)`` of at least :data:`CONFIDENCE`, whatever
    the distribution; with too few values for that, the smallest and the largest."""
    xs = sorted(values)
    n = len(xs)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= CONFIDENCE:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def verdict(values: list[float], limit: float, *, scale: float = 1.0, unit: str = "",
            digits: int = 2) -> tuple[bool | None, str]:
    """Whether the repetitions ``values`` meet ``value <= limit``: True when the median's
    interval is within the limit, False when it is beyond it (each from MIN_REPEATS
    repetitions on), else None; and why: the median's interval (shown times ``scale`` in
    ``unit`` with ``digits`` decimals) and where it lies, or "not resolved (...)"."""
    lo, hi, coverage = median_interval(values)
    n = len(values)
    interval = (f"the median's {coverage:.0%} interval "
                f"{lo * scale:.{digits}f}–{hi * scale:.{digits}f}{unit}")
    if n >= MIN_REPEATS and hi <= limit:
        return True, f"{interval} lies under the limit"
    if n >= MIN_REPEATS and lo > limit:
        return False, f"{interval} lies over the limit"
    where = ("spans the limit" if n >= MIN_REPEATS else
             f"from {n} repetition(s), fewer than {MIN_REPEATS}")
    return None, f"not resolved ({interval} {where})"


def run_order(rows: Sequence[T], rep: int) -> list[T]:
    """The rows of repetition ``rep`` (0-based): in the given order, every other repetition
    reversed, so that a drift along a repetition (a neighbour's load, a warm page cache, the
    previous job's teardown) lands on both sides of each pair instead of always on the rows
    that run later."""
    return list(rows) if rep % 2 == 0 else list(reversed(rows))
