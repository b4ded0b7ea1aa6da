"""``python bench/results/profiles/heavier_model_show.py FILE``: durability's cost on the
reference model and on a heavier one, from runs packed in ``heavier_model_ab.json`` (each a
``python -m bench.serving --only durable --only bare`` record; the heavier model's runs
with ``heavier_model.patch`` applied). Per run, in the order they ran: the model, `bare`'s
tokens/s, the pairs' throughput and CPU cost with the bench's verdict, and durability's
parts in ms of CPU per 1000 tokens (the journal's threads, the checksums), timed where
they run."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(path: str) -> None:
    with open(path) as file:
        packed: dict[str, Any] = json.load(file)
    print(f"{packed['command']}\n")
    for run in packed["runs"]:
        shape, record = packed["shapes"][run["shape"]], run["record"]
        summary = record["summary"]
        checks = [r["passed"] for row in record["runs"].values() for r in row]
        throughput, cpu = record["verdicts"][0], record["verdicts"][-1]
        print(f"{run['shape']} (n_layer={shape['n_layer']}, d_model={shape['d_model']}), "
              f"round {run['round']}: bare {summary['bare']['tokens_per_s']['median']:,.0f} "
              f"tokens/s, checks passed {sum(checks)}/{len(checks)}")
        print(f"  throughput cost {throughput['value']:+.1%}: {throughput['note']}")
        print(f"  server CPU cost {cpu['value']:+.1%}: {cpu['note']}")
        parts = {
            "router": summary["durable"]["router_cpu_ms_per_1k_tokens"]["median"]
            - summary["bare"]["router_cpu_ms_per_1k_tokens"]["median"],
            "of which journal threads": summary["durable"]["journal_cpu_ms_per_1k_tokens"][
                "median"],
            "workers": summary["durable"]["worker_cpu_ms_per_1k_tokens"]["median"]
            - summary["bare"]["worker_cpu_ms_per_1k_tokens"]["median"],
            "of which checksums": summary["durable"]["worker_checksum_ms_per_1k_tokens"][
                "median"],
        }
        server = (summary["bare"]["router_cpu_ms_per_1k_tokens"]["median"]
                  + summary["bare"]["worker_cpu_ms_per_1k_tokens"]["median"])
        print(f"  ms of CPU per 1000 tokens: server (bare) {server:.0f}; durable's extra: "
              + ", ".join(f"{part} {value:+.1f}" for part, value in parts.items()))


if __name__ == "__main__":
    main(sys.argv[1])
