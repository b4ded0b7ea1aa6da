"""Framework presets: the log probes for what a framework itself logs, declared once by name.

A command's ``system: {preset: torchft}`` brings the probes a user would otherwise write by
hand for the lines the framework prints whatever the job does: torchrun's agent (a worker
that failed, with glog's own time), torchft's Manager (the quorum each process enters, the
steps it commits, its heals and errors). Each preset is one small frozen object
(:class:`Preset`) registered by name. Built-in presets live here; other packages add
presets through the ``aftershock.presets`` entry-point group (an object, or a list of
them), loaded on first use. A plug-in that is not a valid preset is named and skipped
(:func:`broken`), never allowed to break a scenario that does not use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aftershock.faults import plugins
from aftershock.harness.run.logprobe import LogProbe

ENTRY_POINT_GROUP = "aftershock.presets"
_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class Preset:
    """A framework's own log lines, as events.

    ``probes`` are ordinary log probes (harness/run/logprobe.py); ``includes`` names presets
    whose probes come with this one (torchft jobs run under torchrun); ``logs`` says, for
    the docs and for `validate`'s advice, which per-process files its lines are in."""

    name: str
    summary: str
    probes: tuple[LogProbe, ...]
    includes: tuple[str, ...] = ()
    logs: str = ""


def _accept(preset: object, found: object) -> Preset:
    if not isinstance(preset, Preset):
        raise plugins.PluginProblem(
            f"not an aftershock.harness.scenario.presets.Preset: {preset!r:.80}")
    if not preset.probes or not all(isinstance(p, LogProbe) for p in preset.probes):
        raise ValueError(f"preset {preset.name!r}: its probes must be one or more LogProbe")
    return preset


def _claims(preset: object) -> list[str]:
    return [preset.name] if isinstance(preset, Preset) else []


#: Every preset, by name: this module's and the entry points'.
PRESETS: plugins.Registry[Preset] = plugins.Registry(
    "preset", ENTRY_POINT_GROUP, name=lambda preset: str(preset.name), accept=_accept,
    claims=_claims, names=(_NAME, "lower-case letters, digits, '_', '.', '-', starting with "
                                  "a letter"), lists_skipped=True)


def register(preset: Preset) -> Preset:
    """Add ``preset``; ValueError when it is not a valid one or its name is taken."""
    return PRESETS.register(preset)


def get(name: str) -> Preset:
    """The preset called ``name``; KeyError naming the known ones otherwise."""
    return PRESETS.get(name)


def names() -> list[str]:
    return PRESETS.names()


def broken() -> dict[str, str]:
    """Entry points of the ``aftershock.presets`` group that were skipped, and why (each
    ``name (module:attribute)``: its one line)."""
    return {f"{skipped.name} ({skipped.value})": skipped.line() for skipped in PRESETS.broken()}


def broken_for(name: str) -> plugins.Broken | None:
    """The skipped plug-in that preset ``name`` may come from, if any."""
    return PRESETS.broken_for(name)


def probes(chosen: str | list[str] | None) -> list[LogProbe]:
    """The probes of the presets ``chosen`` names, and of those they include, each once."""
    wanted = [chosen] if isinstance(chosen, str) else list(chosen or [])
    seen: list[str] = []
    while wanted:
        name = wanted.pop(0)
        if name in seen:
            continue
        seen.append(name)
        wanted.extend(get(name).includes)
    return [p for name in reversed(seen) for p in get(name).probes]


# --------------------------------------------------------------------------- built-in

#: glog's time after its level letter (``E1206 05:33:20.916000 12093 file.py:1002] ...``).
_GLOG_TIME = r"(?P<time>\d{4} \d\d:\d\d:\d\d\.\d+) +\d+ \S+\]"

TORCHRUN = register(Preset(
    name="torchrun",
    summary="torchrun's elastic agent: a worker that failed, with its exit code and pid, "
            "and the agent's decision to restart its group (with LOGLEVEL=INFO), at the "
            "agent's own glog time (restarts also show in the process tree: `generations`)",
    probes=(
        LogProbe(pattern=r"[EW]" + _GLOG_TIME + r" failed \(exitcode: (?P<cause>-?\d+)\) "
                 r"local_rank: \d+ \(pid: (?P<pid>\d+)\)",
                 event="failure_detected", stream="stderr"),
        # The restart decision, logged at INFO (LOGLEVEL=INFO): also a detection, for a
        # worker group that failed without an exit code of its own (a peer's rendezvous).
        LogProbe(pattern=r"I" + _GLOG_TIME + r" \[\w+\] (?P<cause>Worker group FAILED\. "
                 r"\d+/\d+ attempts left; will restart worker group)",
                 event="failure_detected", stream="stderr"),
    ),
    logs="`--log-dir=${run_dir}/torchrun --redirects=3` (no `--tee`): "
         "`logs: ['${run_dir}/torchrun/**/*.log']`",
))

#: torchft's Manager prefixes each line with ``[<replica_id>/<group rank> - step N]``; the
#: replica id is the job's (``train_ddp_1``) with ``:<uuid>`` of the process that runs it,
#: and its trailing digits are the replica group's index (torchft's own reading of it).
#: Each part has a length bound: unbounded, the lazy id and the digits after it try every
#: split of a long run (``[0000...``: a tensor dumped into the log), quadratic in the line,
#: and the probe would give up on the line (harness/run/logprobe.py's PROBE_LINE_S).
_FT = (r"\[(?P<replica_id>[^\s\[\]/]{0,200}?(?P<replica>\d{0,18})(?::[0-9a-f-]{1,64})?)"
       r"/(?P<rank>\d{1,9}) - step ")

TORCHFT = register(Preset(
    name="torchft",
    summary="torchft's Manager (with torchrun's agent): the quorum each process enters "
            "(its world), each step it commits (should_commit=True, numbered as torchft "
            "numbers it), heals and errors; each line proven written after the stamped "
            "line before it in its file (the Rust half's)",
    probes=(
        LogProbe(pattern=_FT + r"\d+\] reconfiguring for quorum_id=(?P<generation>\d+)",
                 event="world_changed"),
        LogProbe(pattern=_FT + r"(?P<step>\d+)\] should_commit=True", event="step"),
        LogProbe(pattern=_FT + r"(?P<step>\d+)\] Loaded state dict", event="recovery_done"),
        LogProbe(pattern=_FT + r"\d+\] got exception in (?P<cause>.{1,200})",
                 event="failure_detected"),
    ),
    includes=("torchrun",),
    logs="torchrun's per-process files, stderr included (Python's logging writes there): "
         "`logs: ['${run_dir}/torchrun/**/*.log']`",
))
