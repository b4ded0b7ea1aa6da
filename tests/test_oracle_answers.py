"""An oracle's answer is a pure function of its module, request and environment: a process
asks it once (a search asks its twin's question every run), never for a failure, and asks
again when any of the three differ."""

from __future__ import annotations

from typing import Any

import pytest

from aftershock.harness import oracle


def test_an_answer_is_asked_once_per_question(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []
    answers: list[dict[str, Any] | str] = []

    def fresh(module: str, request: Any, child: dict[str, str]) -> dict[str, Any] | str:
        asked.append((module, child.get("MKL_CBWR", "")))
        return answers.pop(0)

    monkeypatch.setattr(oracle, "_ANSWERS", {})
    monkeypatch.setattr(oracle, "_ask", fresh)
    answers += ["failed (boom)", {"digests": {"0": "a"}}]
    assert oracle.ask("m", {"seed": 1}) == "failed (boom)"
    first = oracle.ask("m", {"seed": 1})
    assert first == {"digests": {"0": "a"}}
    assert len(asked) == 2  # a failure is asked again
    first["digests"]["0"] = "changed by the caller"
    assert oracle.ask("m", {"seed": 1}) == {"digests": {"0": "a"}}  # kept, not shared
    assert len(asked) == 2
    answers += [{"digests": {"0": "b"}}, {"digests": {"0": "c"}}, {"digests": {"0": "d"}}]
    assert oracle.ask("m", {"seed": 2}) == {"digests": {"0": "b"}}
    assert oracle.ask("m", {"seed": 1}, {"MKL_CBWR": "COMPATIBLE"}) == {"digests": {"0": "c"}}
    assert oracle.ask("other", {"seed": 1}) == {"digests": {"0": "d"}}
    assert len(asked) == 5
