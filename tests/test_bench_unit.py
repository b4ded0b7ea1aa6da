"""The benchmarks' analysis on hand-written timelines: `make bench` is too long for the
suite, so its pure parts are tested here (a renamed metric once broke it silently)."""

from __future__ import annotations

from harness.records import Event


def step(t: float, rank: int, n: int, world: int = 4) -> Event:
    return Event(t=t, event="step", source=f"rank{rank}",
                 fields={"rank": rank, "step": n, "world": world})


def test_training_bench_analysis_of_a_kill_and_a_restart() -> None:
    from bench.run import QUICK, analyse

    events = [Event(t=0.0, event="hello", source=f"rank{r}", fields={"rank": r, "generation": 0})
              for r in range(4)]
    events += [step(0.1 * n, r, n) for n in range(1, QUICK.kill_at + 1) for r in range(4)]
    t_kill = 0.1 * QUICK.kill_at + 0.05
    events.append(Event(t=t_kill, event="fault_injected", source="harness", fields={}))
    events.append(Event(t=t_kill + 0.2, event="failure_detected", source="rank0",
                        fields={"rank": 0, "cause": "peer died"}))
    restart = t_kill + 3.0
    events += [Event(t=restart, event="hello", source=f"rank{r}",
                     fields={"rank": r, "generation": 1}) for r in range(4)]
    # Back from a checkpoint 5 steps behind: those 5 are recomputed.
    events += [step(restart + 0.1 * i, r, QUICK.kill_at - 5 + i)
               for i in range(1, 8) for r in range(4)]
    events.sort(key=lambda e: e.t)
    out = analyse(events, QUICK, t_kill)
    assert out["steps_per_s"] == 10.0
    assert round(out["detect_s"], 3) == 0.2
    assert round(out["resume_s"], 3) == 3.1
    assert round(out["full_s"], 3) == 3.1
    assert out["lost_steps"] == 5
    assert out["restarts"] == 1


def test_serving_bench_verdicts_are_ratios_of_medians() -> None:
    from bench.serving import summarise, verdicts

    runs = {
        "durable": [{"tokens_per_s": 96.0}, {"tokens_per_s": 97.0}],
        "bare": [{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}],
        "migrate": [{"time_to_recover_s": 0.5}],
        "fail_stop": [{"time_to_recover_s": 4.0}],
    }
    overhead, recovery = verdicts(summarise(runs))
    assert round(overhead["value"], 4) == 0.035
    assert overhead["met"]
    assert recovery["value"] == 0.125
    assert not recovery["met"]
