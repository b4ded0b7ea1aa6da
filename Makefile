# Aftershock: `make demo` and `make test` are the whole quick start.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch that this project is tested with. GPU users: see README
# ("Installing on a GPU machine") and override TORCH_SPEC, e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv system-packages bytecode demo test test-busy test-fast test-scenarios test-explore test-explore-long test-long torchft fuzz lint typecheck docs bench bench-targets clean docker-engine slurm-cluster slurm-cluster-stop test-slurm

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" numpy
	$(PY) -m pip install --quiet -e '.[dev,fuse,nodes]'
	touch $(STAMP)

# The system packages the demo and the tests need (ci/system-packages): installed when run as
# root with apt-get, else the one line that installs them is printed and the run goes on
# (what needs them skips or says what to install). Checks commands only: fast when all are there.
system-packages:
	ci/system-packages $(PYTHON)

demo: system-packages venv
	$(VENV)/bin/aftershock run scenarios/training/

# Everything but the sweep over every shipped scenario (with the shipped scenarios against
# broken trainers) and the search for broken trainers, which CI runs as steps of their own.
# The project's own modules compiled once, as an install would: the tests start hundreds of
# Python processes, which otherwise each compile them again where PYTHONDONTWRITEBYTECODE is set.
bytecode: venv
	$(PY) -m compileall -q -j 0 aftershock harness faults reference_impl bench tests examples

# Three test processes (pytest-xdist) on a 2-core machine: the suite waits on real processes,
# signals, sockets and timeouts for about half its wall time, so fewer leave cores idle
# (14.5 -> 10 minutes from two to three; docs/benchmarks.md, "CI's length"). Its verdicts
# hold beside heavier load (make test-busy). TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 3
test: system-packages venv bytecode
	$(PY) -m pytest -m "not scenarios and not explore and not explore_long and not slurm" -n $(TEST_WORKERS)

# Every shipped scenario, through the CLI and the pytest plugin, with its timeline evidence,
# and the shipped scenarios against the broken trainers they exist to catch.
# The scenario sweep runs examples/torchft_ddp too, so it installs torchft first.
# Two workers, as `make test`: a scenario waits on its job's steps and recoveries for much of
# its time, and its verdicts hold beside other load (docs/metrics.md, "How starved the machine
# was"); 46 -> 30 minutes on a 2-core machine (docs/benchmarks.md, "CI's length"). `worksteal`
# hands a worker that ran out a test another has not started, so no long test waits behind
# others while a worker idles. SCENARIO_WORKERS=0 runs it in one process.
SCENARIO_WORKERS ?= 2
test-scenarios: torchft bytecode
	$(PY) -m pytest -m "scenarios and not long" -n $(SCENARIO_WORKERS) --dist worksteal

# torchft 0.2.0 without its dependencies, so it cannot pull a CUDA build of torch over the
# pinned CPU one; the OpenTelemetry packages it imports are installed by name.
torchft: venv
	$(PY) -m pip install --quiet --no-deps torchft==0.2.0
	$(PY) -m pip install --quiet opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http

# A Docker engine for the node scenarios (docs/nodes.md): installs docker.io if missing, starts
# dockerd (no iptables, no default bridge), waits for it and builds the nodes' base image. As
# root; CI runs it before the tests. Without an engine the node tests skip and say why.
docker-engine: venv
	ci/docker-engine $(PY)

# A real Slurm cluster (docs/scale-out.md): installs slurm-wlm and munge if missing, starts the
# engine, then slurmctld and two slurmd nodes as containers, munge, partition `debug`; sinfo,
# sbatch, srun... then work from this host. Idempotent; slurm-cluster-stop leaves nothing.
slurm-cluster: venv
	ci/slurm-cluster up $(PY)

slurm-cluster-stop: venv
	ci/slurm-cluster down $(PY)

# The tests and scenarios that need a Slurm cluster (marker `slurm`): they skip without one
# unless AFTERSHOCK_REQUIRE_SLURM=1, which this target sets, as CI does.
test-slurm: slurm-cluster bytecode
	AFTERSHOCK_REQUIRE_SLURM=1 $(PY) -m pytest -m slurm

# aftershock explore against deliberately broken reference trainers that every shipped
# scenario misses: each must be found and shrunk within 40 runs (tests/test_explore_broken.py).
# Its two long searches side by side, in two workers as the sweep (EXPLORE_WORKERS=0: one).
EXPLORE_WORKERS ?= 2
test-explore: venv bytecode
	$(PY) -m pytest -m explore -n $(EXPLORE_WORKERS) --dist worksteal

# The searches that take about ten minutes each (tests/test_explore_broken_recovery.py,
# tests/test_explore_serving_broken.py).
test-explore-long: venv bytecode
	$(PY) -m pytest -m explore_long

# The evidence that takes about ten minutes: broken variants against every scenario shipped
# before the one that catches them (tests/test_serving_durability_scenarios.py).
test-long: torchft bytecode
	$(PY) -m pytest -m long

# `make test` beside three CPU hogs (busy loops), as on an overloaded CI runner: verdicts must
# not flip with load (docs/metrics.md, "How starved the machine was"). The hogs end with it.
BUSY_HOGS ?= 3
test-busy: venv bytecode
	@hogs=""; for i in $$(seq $(BUSY_HOGS)); do \
	  $(PY) -c 'while True: pass' & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest -m "not scenarios and not explore and not explore_long and not slurm" -n $(TEST_WORKERS)

test-fast: venv bytecode
	$(PY) -m pytest -m "not slow and not scenarios and not explore and not explore_long and not slurm" -n $(TEST_WORKERS)

# 10,000 malformed scenario files through the loader, and 1,250 of them through
# `aftershock validate` under CPU and memory limits (tests/test_fuzz_spec.py; `make test` runs
# a fixed sample of 300). Random each time; a failure is kept in .hypothesis/ and replayed first.
FUZZ_EXAMPLES ?= 10000
fuzz: venv
	AFTERSHOCK_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/test_fuzz_spec.py \
		--timeout=3600 --hypothesis-show-statistics

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The generated part of docs/faults.md, from each fault kind's declaration (installed
# kinds included). tests/test_docs_faults.py fails when it is stale.
docs: venv
	$(PY) -m aftershock.faults.catalogue docs/faults.md

# Side-by-side benchmarks (docs/benchmarks.md, docs/serving.md), then what `aftershock run` costs
# beyond the job itself on a shipped scenario (bench/harness_overhead.py).
bench: torchft
	$(PY) -m bench
	$(PY) -m bench.serving
	$(PY) -m bench.harness_overhead

# The failure-free overhead targets with 16 repetitions each: `make bench`'s 3 never resolve
# them on a noisy 2-core host, 16 sometimes do (bench/results/history-2026-12.md, "The
# 16-repetition runs"). ~17–23 minutes. Writes bench/results/partial.* and
# serving-partial.*, and keeps every training job's events and logs under
# $(BENCH_LOGS)/<UTC time>/repN/ROW (~0.2 MB a job, outside git), so an outlier can be
# explained after the run.
BENCH_LOGS ?= .aftershock/bench-logs
bench-targets: venv
	$(PY) -m bench --only ddp,trainer_no_ckpt,hot_spare,elastic --repeat 16 \
		--keep-logs $(BENCH_LOGS)/$$(date -u +%Y%m%dT%H%M%SZ)
	$(PY) -m bench.serving --only durable --only bare --repeat 16

clean:
	rm -rf .aftershock .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
