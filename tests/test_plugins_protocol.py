"""The plug-in protocols, checked when a kind registers (faults/plugins.py): what a fault
kind and a system kind must and may declare, the optional hooks read in one place
(aftershock.faults.registry.Hooks), and which broken plug-in a scenario's name may be asking for."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT

from aftershock import faults
from aftershock.faults import Applied, KindInfo, plugins, registry
from aftershock.faults.params import FaultParams
from aftershock.harness import systems


class _Kind:
    info = KindInfo(kind="test.protocol", summary="a test kind", caused_by="nothing")
    params = FaultParams

    def inject(self, target: Any, params: Mapping[str, Any], journal: Any) -> Applied:
        return Applied(self.info.kind, None, {}, "nothing")

    def revert(self, undo: Mapping[str, Any]) -> None:
        pass


def test_the_optional_hooks_are_read_once_typed_and_defaulted() -> None:
    plain = registry.check(_Kind())
    assert plain == registry.Hooks(params=FaultParams)
    assert (plain.acts, plain.needs, plain.preflight, plain.default_target) == (
        "outside", frozenset(), None, None)

    memory = faults.get("memory.nan")
    found = faults.hooks(memory)
    assert found.acts == "either"
    assert found.inside is not None
    assert found.resolve is not None
    assert found.inside_when == memory.inside_when  # type: ignore[attr-defined]
    assert faults.hooks(faults.get("storage.delete")).default_target == {"role": "launcher"}
    assert faults.hooks(faults.get("storage.lose_unsynced")).check is not None


@pytest.mark.parametrize(
    ("attrs", "problem"),
    [
        ({"acts": "outsde"}, "`acts` is 'outsde'; allowed: 'outside', 'inside', 'either'"),
        (
            {"needs": frozenset({"gpu"})},
            "`needs` is frozenset({'gpu'}), not a frozenset of " + ", ".join(faults.CAPABILITIES),
        ),
        ({"preflight": "yes"}, "`preflight` is 'yes', not a method: preflight(params)"),
        (
            {"params": dict},
            "`params` is <class 'dict'>, not an aftershock.faults.params.FaultParams model",
        ),
        ({"acts": "either"}, "`acts` is 'either' but it gives no `inside(params, phase)`"),
        (
            {"info": KindInfo(kind="Preempt", summary="s", caused_by="c")},
            "`info` is KindInfo(kind='Preempt'",
        ),
        ({"default_target": "launcher"}, "`default_target` is 'launcher', not a mapping or None"),
    ],
)
def test_a_kind_the_protocol_does_not_allow_is_refused_saying_what_is_wrong(
    attrs: dict[str, Any], problem: str
) -> None:
    kind = type("Bad", (_Kind,), attrs)()
    with pytest.raises(ValueError, match=re.escape(problem)):
        registry.register(kind)
    assert "test.protocol" not in registry.KINDS


def test_a_kind_without_its_required_parts_names_each_one() -> None:
    class Empty:
        pass

    with pytest.raises(plugins.PluginProblem) as refused:
        faults.register(Empty())  # type: ignore[arg-type]
    assert str(refused.value) == (
        "fault kind (a test_a_kind_without_its_required_parts_names_each_one.<locals>.Empty): "
        "no `info` (a faults.KindInfo with a dotted lower-case `kind`, a `summary` and "
        "`caused_by`); "
        "no `inject` (a method: inject(target, params, journal)); "
        "no `revert` (a method: revert(undo))"
    )


def test_a_system_kind_is_checked_against_its_protocol() -> None:
    built_in = systems.get("command")

    class Half:
        name, model, tag, shape, order = "half", built_in.model, ("half", None), "`half`", 9
        family, golden = "train", "digests"

    with pytest.raises(
        ValueError,
        match=r"system kind half: `family` is 'train'; allowed: "
        r"'training', 'serving'; no `launch` \(a method\); no `target`",
    ):
        systems.register(Half())  # type: ignore[arg-type]
    assert "half" not in systems.KINDS
    assert systems.unresolved(built_in) is not None  # the command kind's optional hook
    assert systems.unawaited(systems.get("trainer")) is not None  # the trainer's
    assert systems.unresolved(systems.get("slurm")) is None
    assert systems.unawaited(built_in) is None


def test_a_broken_plugin_is_matched_by_what_it_claims_or_by_its_entry_points_name() -> None:
    named = plugins.Broken("aftershock.faults", "whatever", "m:X", "d 1", "bad", ("a.b",))
    assert named.provides("a.b")
    assert not named.provides("whatever")
    unnamed = plugins.Broken("aftershock.faults", "preempt_notice", "m:X", "d 1", "bad")
    assert unnamed.provides("preempt.notice")
    assert unnamed.provides("Preempt-Notice.soon")  # a list of kinds under one entry point
    assert not unnamed.provides("preempt")
    assert not unnamed.provides("preempt.noticed")


def test_no_other_module_looks_a_kinds_hooks_up_by_name() -> None:
    # The optional parts of a fault kind are read in faults/registry.py (Hooks) and system
    # kinds' in harness/systems/__init__.py; a `getattr(kind, "hook")` elsewhere is a second
    # reading of the protocol that validation at registration would not cover.
    lookup = re.compile(r"getattr\(\s*(kind|k|fault_kind|faults\.get\([^)]*\))\s*,")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("faults", "harness")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name not in ("registry.py", "plugins.py")
        and path.relative_to(ROOT).as_posix() != "harness/systems/__init__.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if lookup.search(line)
    ]
    assert found == []


class _Widget:
    def __init__(self, name: str) -> None:
        self.name = name


def _widgets(**kwargs: Any) -> plugins.Registry[_Widget]:
    return plugins.Registry("widget", "aftershock.test_widgets", name=lambda w: w.name,
                            protocol=(plugins.required("name", "a str", plugins.is_str),),
                            **kwargs)


def test_a_registry_loads_its_group_once_refuses_what_is_wrong_and_names_what_is_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_widgets.py").write_text(
        "class W:\n    name = 'from.plugin'\nWIDGET = W()\n")
    info = tmp_path / "my_widgets-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-widgets\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(
        "[aftershock.test_widgets]\nmine = my_widgets:WIDGET\nbad_one = json:loads\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    built_in = _Widget("built.in")
    widgets = _widgets(built_ins=lambda: widgets.register(built_in))
    assert widgets.names() == ["built.in", "from.plugin"]
    assert widgets.register(built_in) is built_in  # the same one again is no conflict
    with pytest.raises(ValueError, match=r"^widget 'built\.in' is registered twice$"):
        widgets.register(_Widget("built.in"))
    with pytest.raises(plugins.PluginProblem, match=r"^widget \(a int\): no `name` \(a str\)$"):
        widgets.register(3)
    (skipped,) = widgets.broken()
    assert skipped.line() == ("plug-in skipped: my-widgets 2.0, entry point "
                              "aftershock.test_widgets: bad_one = json:loads: widget (a function): "
                              "no `name` (a str)")
    assert widgets.broken_for("bad.one") is skipped
    with pytest.raises(KeyError) as unknown:
        widgets.get("bad.one")
    assert unknown.value.args[0] == (
        f"unknown widget 'bad.one' (known: built.in, from.plugin); {skipped.line()}")
    monkeypatch.setenv(plugins.NO_PLUGINS_ENV, "1")
    assert _widgets().names() == []


def test_a_test_adds_an_entry_for_a_block_and_leaves_the_registry_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _Widget("a.widget")
    widgets = _widgets(built_ins=lambda: widgets.register(first))
    stand_in = _Widget("a.widget")
    with widgets.added(stand_in) as added, widgets.added(_Widget("b.widget")):
        assert added is stand_in
        assert widgets.get("a.widget") is stand_in
        assert widgets.names() == ["a.widget", "b.widget"]
    assert widgets.get("a.widget") is first
    assert widgets.names() == ["a.widget"]
    with pytest.raises(plugins.PluginProblem), widgets.added(object()):
        pass  # checked as any entry is
    (tmp_path / "late_widgets.py").write_text("class W:\n    name = 'late'\nLATE = W()\n")
    info = tmp_path / "late_widgets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-widgets\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[aftershock.test_widgets]\nlate = late_widgets:LATE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late" not in widgets  # loaded already, before the distribution was there
    with widgets.reloaded():
        assert widgets.names() == ["a.widget", "late"]
    assert widgets.names() == ["a.widget"]


def test_the_four_plug_in_groups_are_one_registry_type() -> None:
    from aftershock.harness.scenario import presets
    from aftershock.harness.verdict import check_registry

    groups = {r.group for r in (registry.KINDS, systems.KINDS, presets.PRESETS,
                                check_registry.PLUGINS)}
    assert groups == {"aftershock.faults", "aftershock.systems", "aftershock.presets",
                      "aftershock.checks"}
    # Loading entry points, or keeping a registry's dict, anywhere else is a second copy.
    copies = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("faults", "harness")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != "faults/plugins.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"plugins\.load\(|entry_points\(|^_registry\b", line)
    ]
    assert copies == []
