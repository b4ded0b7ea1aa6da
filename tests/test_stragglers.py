"""The reference trainer's straggler rule on windows measured on a loaded 2-core host.

Each case is a real window of scenarios/faults/straggle_rank.yaml or of its fault-free
twin: every rank's busy seconds (CPU time plus wait for a CPU, or compute time) and the
window's wall time. The rule must name the throttled rank and nobody in the noise.
"""

from __future__ import annotations

import pytest

from reference_impl import trainer


@pytest.mark.parametrize(
    ("values", "window", "named"),
    [
        # rank 3 held to 5% of a CPU for the whole window
        ([0.12, 0.094, 0.0852, 1.2656], 1.714, [3]),
        ([0.2143, 0.14, 0.1793, 1.0203], 1.862, [3]),
        # fault-free, quiet and loaded
        ([0.2722, 0.2542, 0.2748, 0.2688], 1.082, []),
        ([0.4751, 0.2545, 0.2348, 0.3229], 1.16, []),
        # twice the median, but a tenth of a second of jitter is not a straggler: the old
        # rule (ratio alone, over forward+backward time) named rank 0 in windows like this
        ([0.0498, 0.0199, 0.021, 0.019], 1.0, []),
        ([0.05, 0.30, 0.06, 0.05], 1.2, []),
    ],
)
def test_a_straggler_is_twice_the_median_and_costs_a_share_of_the_window(
    values: list[float], window: float, named: list[int]
) -> None:
    assert [rank for rank, _ in trainer.stragglers(values, window)] == named


def test_without_a_window_the_ratio_alone_decides() -> None:
    assert [rank for rank, _ in trainer.stragglers([0.05, 0.30, 0.06, 0.05])] == [1]
