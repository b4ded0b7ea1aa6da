"""The contract between the harness, the in-process probe and the fault engine: what a
launched process finds in its environment, and the timeline events they tell each other.

Standard library only, importing nothing: the probe (harness/probe.py) imports it in every
rank of every job. docs/events.md describes every event; these are the ones one side
writes and another side acts on.
"""

from __future__ import annotations

# ------------------------------------------------------------- environment of a launched job

#: The run's timeline (``events.jsonl``): the probe appends its events there.
EVENTS_ENV = "AFTERSHOCK_EVENTS"
#: The run's command file: in-process faults the harness armed (faults/inproc.py).
COMMANDS_ENV = "AFTERSHOCK_COMMANDS"
#: A folder where the system under test may leave artifacts (final parameters, logs).
OUTPUT_ENV = "AFTERSHOCK_OUTPUT_DIR"
#: The run's id: every process the harness launches carries it, so its processes are found
#: again even after they left the run's cgroup (and by `aftershock heal` after a crash).
RUN_ID_ENV = "AFTERSHOCK_RUN_ID"
#: The simulated NVML a rank without a GPU reads (faults/nvml_sim.py), where gpu.xid writes.
NVML_DIR_ENV = "AFTERSHOCK_NVML_DIR"
#: The node (0, 1, ...) a process runs on, in a multi-node run (harness/nodes/): its pid in
#: events is the one inside that node's PID namespace, so a hello names the node too.
NODE_ENV = "AFTERSHOCK_NODE"
#: Test hooks that break a system through its environment start with this: they are
#: faults, so the fault-free twin goes without them.
INJECT_PREFIX = "AFTERSHOCK_INJECT_"

# ------------------------------------------------------------- the harness's own settings

#: Where heal journals live (faults/journal.py).
STATE_ENV = "AFTERSHOCK_STATE_DIR"
#: Where fault-free twins' results are cached (harness/twin/baseline.py).
CACHE_ENV = "AFTERSHOCK_CACHE_DIR"

# ------------------------------------------------------------- events the other side acts on

#: A process says who it is: pid, rank, role, world, generation (the target maps ranks).
HELLO = "hello"
#: A step is committed (the schedule's `at: {step}` and every step metric).
STEP = "step"
#: Where each CPU parameter of a rank lives (memory faults with `address_of`).
TENSORS = "tensors"
#: A fault was applied: by the harness from outside, or by the probe at its moment.
FAULT_INJECTED = "fault_injected"
#: A server listens at ``url`` (the load generator starts).
SERVING_READY = "serving_ready"

# ------------------------------------------------------------- events the checks and metrics read
# (docs/events.md says who writes each; harness/verdict/checks.py and harness/verdict/metrics.py
# judge them)

#: The system noticed a failure (``cause``): time to detect.
FAILURE_DETECTED = "failure_detected"
#: The system says it recovered.
RECOVERY_DONE = "recovery_done"
#: A world formed or changed: its members, generation (``snapshot_every`` where it snapshots).
MEMBERSHIP = "membership"
WORLD_CHANGED = "world_changed"
#: Checkpoints: saved (``step``, ``path``), resumed from, rejected by the loader.
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_LOADED = "checkpoint_loaded"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
#: A rank's final parameter digest.
PARAMS = "params"
#: A process answered an Xid with an action (``code``, ``action``).
XID_ACTION = "xid_action"
#: The system named a slow rank (``slow_rank``).
STRAGGLER_DETECTED = "straggler_detected"
#: The harness saw a process of the run start, exit, or a log appear.
PROCESS_STARTED = "process_started"
TARGET_EXITED = "target_exited"
LOG_APPEARED = "log_appeared"
#: The run ended: on its own (``run_end``) or stopped at its timeout.
RUN_END = "run_end"
TIMEOUT = "timeout"
#: The load generator and its requests.
LOAD_STARTED = "load_started"
LOAD_NOT_READY = "load_not_ready"
REQUEST_SENT = "request_sent"
REQUEST_DONE = "request_done"
REQUEST_FAILED = "request_failed"
REQUEST_MIGRATED = "request_migrated"
SERVING_STATS = "serving_stats"
