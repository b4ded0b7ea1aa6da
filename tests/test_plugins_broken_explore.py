"""A broken plug-in named by an `explore:` block: exit 3 and the plug-in's line, as `run`
and `validate` do for one named in `faults:` (docs/cli.md, docs/extending.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plugins_broken import KINDS, PLAIN, WARNING, aftershock, install

pytestmark = pytest.mark.timeout(120)

LINE = ("plug-in skipped: aftershock-broken 0.3, entry point aftershock.faults: "
        "preempt_notice = broken_kinds:NO_INFO")


def searches(path: Path, kinds: str) -> Path:
    path.write_text(PLAIN.replace("faults: []", f"faults: []\nexplore:\n  kinds: {kinds}\n"))
    return path


def test_an_explore_block_naming_a_broken_kind_exits_3_naming_the_plug_in(
        tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, "aftershock-broken", "0.3",
            "[aftershock.faults]\npreempt_notice = broken_kinds:NO_INFO\n",
            {"broken_kinds": KINDS})
    bare = searches(tmp_path / "bare.yaml", "[preempt.notice]")
    mapped = searches(tmp_path / "mapped.yaml", "[process.kill, {kind: preempt.notice}]")
    for command in ("validate", "explore"):
        extra = ["--runs", "1", "--no-db", "--plain", "--out", str(tmp_path / "out")] if (
            command == "explore") else []
        for scenario, where in ((bare, "6:11: explore.kinds.0"),
                                (mapped, "6:32: explore.kinds.1.kind")):
            refused = aftershock(command, str(scenario), *extra, site=site, cwd=tmp_path)
            assert refused.returncode == 3, refused.stdout + refused.stderr
            assert f"{scenario}:{where}: {LINE}" in refused.stderr
            assert "unknown fault kind" not in refused.stderr
            assert "Traceback" not in refused.stderr
    assert not list((tmp_path / "out").glob("*"))  # nothing ran

    # A search that does not use it is valid, with the one warning line.
    fine = searches(tmp_path / "fine.yaml", "[process.kill]")
    checked = aftershock("validate", str(fine), site=site, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert [line for line in checked.stderr.splitlines() if line.startswith(WARNING)] == [
        checked.stderr.strip()]
