"""docs/faults.md's list of kinds is the kinds' own declarations, never a copy gone stale."""

from __future__ import annotations

from _helpers import ROOT

from aftershock.faults import catalogue, registry


def builtin_kinds() -> list[registry.FaultKind]:
    kinds = catalogue.builtin()
    assert len(kinds) >= 21  # every built-in kind, not an empty page that matches itself
    return kinds


def test_the_generated_part_of_faults_md_is_up_to_date() -> None:
    page = (ROOT / "docs" / "faults.md").read_text()
    assert catalogue.rewrite(page, builtin_kinds()) == page, (
        "docs/faults.md is stale: run `make docs` "
        "(python -m aftershock.faults.catalogue docs/faults.md)"
    )


def test_every_parameter_of_every_kind_is_in_the_docs() -> None:
    page = (ROOT / "docs" / "faults.md").read_text()
    for kind in builtin_kinds():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{kind.info.kind}` |"))
        for name in kind.params.model_fields:
            assert f"`{name}`:" in row, (kind.info.kind, name)


def test_a_changed_default_makes_the_page_stale() -> None:
    page = (ROOT / "docs" / "faults.md").read_text()
    term = registry.get("process.term")
    assert "default 5s" in catalogue.markdown([term])
    changed = page.replace(
        "time allowed to exit cleanly (duration; default 5s)",
        "time allowed to exit cleanly (duration; default 9s)",
    )
    assert changed != page
    assert catalogue.rewrite(changed, builtin_kinds()) == page
