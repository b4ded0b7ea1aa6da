"""`python -m bench.status`: a target's status across runs of the same code. Two
16-repetition runs of one tree once disagreed beyond either run's interval
(docs/benchmarks.md, "Run J"), so one run's "met" must not settle a target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.status import StatusError, code_identity, load, main, status

HOT = "hot_spare failure-free overhead ≤ 10% vs plain DDP"
TRAINER = "trainer loop alone (trainer_no_ckpt) ≤ 3% vs plain DDP"
SERVING = ("journal + checksums cost <= 5% of fault-free throughput "
           "(median of the paired repetitions)")


def record(path: Path, verdicts: dict[str, bool | None], *, digest: str | None = "abc",
           serving: bool = False) -> Path:
    lines = [{"target": t, "value": 0.05, "met": met, "note": f"note of {t}"}
             for t, met in verdicts.items()]
    body: dict[str, Any] = {"verdicts" if serving else "targets": lines}
    if digest is not None:
        body["code"] = {"commit": "0" * 40, "dirty": False, "digest": digest}
    path.write_text(json.dumps(body))
    return path


def test_met_needs_every_run_and_two_of_them(tmp_path: Path) -> None:
    h = record(tmp_path / "h.json", {HOT: True, TRAINER: None})
    j = record(tmp_path / "j.json", {HOT: None, TRAINER: False})
    k = record(tmp_path / "k.json", {HOT: True, TRAINER: True})
    found = {s.target: s for s in status(load([h, j, k]))}
    # Met in H and K, not resolved in J: the runs disagree, nothing is settled.
    assert found[HOT].status == "not resolved"
    assert found[HOT].why == "2 of 3 run(s) resolved it under the limit, none over"
    # One run over the limit decides, whatever the others said.
    assert found[TRAINER].status == "not met"
    assert found[TRAINER].why == "1 of 3 run(s) resolved it over the limit"
    assert [r.met for r in found[TRAINER].runs] == [None, False, True]
    both = {s.target: s for s in status(load([h, k]))}
    assert both[HOT].status == "met"
    alone = {s.target: s for s in status(load([h]))}
    assert alone[HOT].status == "not resolved"
    assert alone[HOT].why == "met in the one run that measured it; met needs two or more"


def test_serving_records_read_the_same_way(tmp_path: Path) -> None:
    a = record(tmp_path / "a.json", {SERVING: True}, serving=True)
    b = record(tmp_path / "b.json", {SERVING: None}, serving=True)
    (only,) = status(load([a, b]))
    assert (only.target, only.status) == (SERVING, "not resolved")


def test_records_of_different_code_are_refused(tmp_path: Path) -> None:
    a = record(tmp_path / "a.json", {HOT: True}, digest="1111111111111111")
    b = record(tmp_path / "b.json", {HOT: True}, digest="2222222222222222")
    with pytest.raises(StatusError, match="measured different code") as err:
        load([a, b])
    assert str(a) in str(err.value)
    assert str(b) in str(err.value)
    assert "--mixed" in str(err.value)
    assert status(load([a, b], mixed=True))[0].status == "met"


def test_a_record_that_does_not_say_its_code_is_refused(tmp_path: Path) -> None:
    old = record(tmp_path / "old.json", {HOT: True}, digest=None)
    with pytest.raises(StatusError, match=r"old\.json: the record does not say what code"):
        load([old])
    assert len(load([old], mixed=True)) == 1


def test_bad_input_names_the_file_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    md = tmp_path / "partial.md"
    md.write_text("| row | steps/s |\n")
    assert main([str(md)]) == 2
    said = capsys.readouterr().err
    assert f"{md}:1:1: not JSON" in said
    assert "not its .md" in said
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main([str(empty)]) == 2
    assert "no targets in it" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_the_table_names_each_runs_verdict(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    h = record(tmp_path / "h.json", {TRAINER: None})
    j = record(tmp_path / "j.json", {TRAINER: False})
    assert main([str(h), str(j)]) == 0
    out = capsys.readouterr().out
    assert (f"| {TRAINER} | **not met** | 1 of 2 run(s) resolved it over the limit | "
            "h.json: neither; j.json: over |") in out


def test_the_code_digest_follows_the_python_not_the_records(tmp_path: Path) -> None:
    for folder in ("reference_impl", "harness", "faults", "bench"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(f"# {folder}\n")
    (tmp_path / "bench" / "results").mkdir()
    (tmp_path / "bench" / "results" / "partial.json").write_text("{}")
    first = code_identity(tmp_path)
    assert first["commit"] is None  # not a git checkout: the digest alone says it
    (tmp_path / "bench" / "results" / "partial.json").write_text('{"runs": 1}')
    (tmp_path / "docs.md").write_text("new docs")
    # A runner kept beside its raw rounds is a record of a measurement, not what measured it.
    (tmp_path / "bench" / "results" / "profiles").mkdir()
    (tmp_path / "bench" / "results" / "profiles" / "ab.py").write_text("ROUNDS = 6\n")
    assert code_identity(tmp_path)["digest"] == first["digest"]
    (tmp_path / "reference_impl" / "trainer.py").write_text("STEPS = 1\n")
    second = code_identity(tmp_path)
    assert second["digest"] != first["digest"]
    (tmp_path / "reference_impl" / "trainer.py").write_text("STEPS = 2\n")
    assert code_identity(tmp_path)["digest"] != second["digest"]


def test_this_checkout_has_an_identity_and_a_copy_has_the_same_digest(tmp_path: Path) -> None:
    here = code_identity()
    assert here["commit"]
    assert len(str(here["commit"])) == 40
    root = Path(__file__).resolve().parent.parent
    for folder in ("reference_impl", "harness", "faults", "bench"):
        shutil.copytree(root / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    assert code_identity(tmp_path)["digest"] == here["digest"]


def test_a_target_no_run_measured_is_not_measured(tmp_path: Path) -> None:
    """`--only durable --only bare` runs no recovery rows; a training run without torchft
    has no peer to compare with: neither is a verdict, in any number of runs."""
    lines = [{"target": "time to recover <= 1/10 of fail-stop", "value": None, "met": None,
              "note": "not measured (no migrate or fail_stop runs)"},
             {"target": "hot_spare kill → survivors commit ≤ torchft 1 s", "value": 0.12,
              "limit": None, "met": None, "note": "a peer row missing"},
             {"target": TRAINER, "value": None, "limit": 0.03, "met": None,
              "note": "trainer_no_ckpt missing"},
             {"target": HOT, "value": 0.05, "limit": 0.1, "met": True, "note": "under"}]
    paths = []
    for name in ("a.json", "b.json"):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps({"targets": lines, "code": {"digest": "d"}}))
    found = {s.target: s for s in status(load(paths))}
    assert found["time to recover <= 1/10 of fail-stop"].status == "not measured"
    assert found["hot_spare kill → survivors commit ≤ torchft 1 s"].status == "not measured"
    assert found[TRAINER].status == "not measured"  # `--only ddp,hot_spare`, say
    assert found[HOT].status == "met"
    assert found[HOT].why == "every one of 2 runs resolved it under the limit"


def test_records_are_read_from_the_commits_that_keep_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each `make bench-targets` run overwrites `bench/results/partial.json`, so the docs
    cite a run's record by the commit that keeps it. `REV:PATH` reads it from git, and the
    table names the runs so that two records with one file name stay apart."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    revs = []
    for met in (None, False):
        record(results / "partial.json", {TRAINER: met})
        git("add", ".")
        git("commit", "-qm", f"run {met}")
        revs.append(git("rev-parse", "--short", "HEAD"))
    (results / "partial.json").unlink()  # not in the tree any more: git alone has them
    monkeypatch.chdir(tmp_path)
    first, second = (f"{rev}:bench/results/partial.json" for rev in revs)
    assert main([first, second]) == 0
    out = capsys.readouterr().out
    assert (f"| {TRAINER} | **not met** | 1 of 2 run(s) resolved it over the limit | "
            f"{first}: neither; {second}: over |") in out
    # Two files of one name in different folders are told apart the same way.
    for i, rev in enumerate(revs):
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "partial.json").write_text(
            git("show", f"{rev}:bench/results/partial.json"))
    assert main(["run0/partial.json", "run1/partial.json"]) == 0
    assert "run0/partial.json: neither; run1/partial.json: over |" in capsys.readouterr().out
    # A revision or a path git does not have: named, with git's reason and the fix.
    assert main([f"{revs[0]}:bench/results/serving.json"]) == 2
    said = capsys.readouterr().err
    assert f"{revs[0]}:bench/results/serving.json: no such file, and git cannot show it" in said
    assert "does not exist in" in said  # git's own reason
    assert "a file that exists on disk" in said
    assert main(["nosuchrev:bench/results/partial.json"]) == 2
    assert "git cannot show it" in capsys.readouterr().err
