"""The serving oracle's judge: a server twin's tokens against the model's math, run apart.

``judge_outputs`` sends the load's prompts (drawn from the seed, as the load generator draws
them) and the twin's tokens to ``python -m aftershock.harness.oracle.serving_math``, a fresh process
that imports nothing from ``reference_impl`` and recomputes greedy decoding with one plain
forward pass per sequence (no engine, KV cache or batching). This module stays torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aftershock.harness.oracle import ask
from aftershock.harness.run.loadgen import plan

if TYPE_CHECKING:
    from aftershock.harness.systems.server import ServerSystem

#: ~0.5 s of math for 60 requests after torch's import; this only bounds a hang.
NAME = "the serving oracle (aftershock.harness.oracle.serving)"


@dataclass(frozen=True, slots=True)
class Judgement:
    """Whether the twin's tokens are greedy decoding's; None: not judged (``note`` says why)."""

    agrees: bool | None
    observed: str
    note: str


def tokens_of(output: Any) -> list[int]:
    """A twin's output as tokens: a ``metrics.Output``, its JSON form or a token list."""
    data = output.to_json() if hasattr(output, "to_json") else output
    tokens = data.get("tokens") if isinstance(data, Mapping) else data
    return [int(t) for t in tokens or ()]


def _ask(body: Mapping[str, Any], env: Mapping[str, str] | None
         ) -> tuple[list[Any], int] | str:
    """The oracle process's answer to ``body``: the requests that disagree and the count
    of near-tied tokens; or why there is none."""
    answer = ask("aftershock.harness.oracle.serving_math", body, env)
    if isinstance(answer, str):
        return f"{NAME} {answer}"
    try:
        return list(answer["disagree"]), int(answer["ties"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"{NAME} said nothing usable ({exc})"


def judge_outputs(system: ServerSystem, *, seed: int, outputs: Mapping[str, Any],
                  env: Mapping[str, str] | None = None) -> Judgement:
    """The twin's ``outputs`` (by request id) against the oracle's greedy decoding of the
    load ``system`` serves with ``seed``. ``env``: settings for the oracle's process."""
    requests = plan(system.load, seed)
    ids = {r.id for r in requests}
    missing = sorted(ids - set(outputs))
    extra = sorted(set(outputs) - ids)
    if missing or extra:
        shown = ", ".join([*(f"{r} missing" for r in missing[:3]),
                           *(f"{r} never sent" for r in extra[:3])])
        return Judgement(False, f"{len(outputs)}/{len(requests)} requests",
                         f"the twin's requests are not the load's ({shown})")
    body = {"model_seed": system.model_seed, "requests": [
        {"id": r.id, "prompt": list(r.prompt.encode("utf-8")), "max_tokens": r.max_tokens,
         "tokens": tokens_of(outputs[r.id])} for r in requests]}
    answer = _ask(body, env)
    if isinstance(answer, str):
        return Judgement(None, "", answer)
    disagree, ties = answer
    agree = len(requests) - len(disagree)
    observed = f"{agree}/{len(requests)} requests equal the oracle"
    tie_note = f"; {ties} near-tied tokens taken as the twin chose" if ties else ""
    if disagree:
        first = disagree[0]
        return Judgement(
            False,
            observed,
            f"{len(disagree)} requests differ from greedy decoding, first "
            f"{first.get('id')} at token {first.get('index')}: "
            f"{first.get('why')}{tie_note}",
        )
    return Judgement(True, observed, f"every token is greedy decoding's{tie_note}")
