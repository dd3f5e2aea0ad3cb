"""Does this host have what the GPU stack needs? Asked before `make up`, `make build`, `make test-gpu` and the GPU
demo pull or build anything, so a GPU-less host stops in seconds with one message naming CPU=1, not after minutes
of pulling multi-GB CUDA images that can never start.

Standard library only: `make` runs it with the system python3 before `make setup` has made the venv.

    python3 -m lorafleet_ops.host_check --for "make up" --docker   # an NVIDIA GPU and Docker's nvidia runtime
    python3 -m lorafleet_ops.host_check --for "make demo GPU=1"    # an NVIDIA GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass

EXIT_MISSING = 3
TIMEOUT_S = 20.0  # nvidia-smi on a wedged driver, docker info on an engine that does not answer


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it: its host index (what CUDA_VISIBLE_DEVICES and VLLM_GPUS name) and memory."""

    index: int
    name: str
    memory_mib: int


class NoGpu(RuntimeError):
    """nvidia-smi is missing, fails, or lists no GPU; the message says which."""


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def parse_gpus(text: str) -> list[Gpu]:
    """The rows of `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        head, _, memory = line.rpartition(",")
        index, _, name = head.partition(",")
        gpus.append(Gpu(int(index), name.strip(), int(float(memory))))
    return gpus


def nvidia_gpus() -> list[Gpu]:
    """The host's NVIDIA GPUs by nvidia-smi (the driver's own tool: no CUDA python needed)."""
    if shutil.which("nvidia-smi") is None:
        raise NoGpu("no NVIDIA GPU found: nvidia-smi is not on PATH (no NVIDIA driver installed)")
    try:
        done = _run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"])
    except subprocess.TimeoutExpired:
        raise NoGpu(f"no NVIDIA GPU found: nvidia-smi did not answer in {TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise NoGpu(f"no NVIDIA GPU found: nvidia-smi failed (exit {done.returncode}: "
                    f"{_first_line(done.stderr + done.stdout)})")
    try:
        gpus = parse_gpus(done.stdout)
    except (ValueError, IndexError):
        raise NoGpu(f"no NVIDIA GPU found: nvidia-smi answered no GPU list ({_first_line(done.stdout)})") from None
    if not gpus:
        raise NoGpu("no NVIDIA GPU found: nvidia-smi lists none")
    return gpus


def docker_runtime_problem() -> str | None:
    """Why Docker cannot start GPU containers (None: its engine has the nvidia runtime)."""
    if shutil.which("docker") is None:
        return "no Docker to run GPU containers: no docker CLI on PATH"
    try:
        done = _run(["docker", "info", "--format", "{{json .Runtimes}}"])
    except subprocess.TimeoutExpired:
        return f"no Docker engine to check for the nvidia runtime: `docker info` did not answer in {TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return ("no Docker engine to check for the nvidia runtime: `docker info` failed "
                f"({_first_line(done.stderr + done.stdout)})")
    try:
        runtimes = json.loads(done.stdout or "{}")
    except json.JSONDecodeError:
        return f"Docker has no nvidia runtime: `docker info` answered {_first_line(done.stdout)!r}"
    if "nvidia" not in (runtimes or {}):
        found = ", ".join(sorted(runtimes or {})) or "none"
        return (f"Docker has no nvidia runtime (runtimes: {found}): install the NVIDIA Container Toolkit and run "
                "`nvidia-ctk runtime configure --runtime=docker`, then restart Docker")
    return None


def problems(docker: bool) -> list[str]:
    """Everything missing for the GPU path: the GPU, and with `docker` the engine's nvidia runtime."""
    found = []
    try:
        nvidia_gpus()
    except NoGpu as exc:
        found.append(str(exc))
    if docker and (problem := docker_runtime_problem()):
        found.append(problem)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet_ops.host_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--for", dest="target", default="make up", help="what is being run, for the message")
    parser.add_argument("--docker", action="store_true", help="also need Docker's nvidia runtime (the stack)")
    parser.add_argument("--instead", default="CPU=1 (the CPU profile)",
                        help="how to run it without a GPU, for the message (default: CPU=1)")
    args = parser.parse_args(argv)
    found = problems(args.docker)
    if not found:
        return 0
    print(f"{args.target} stopped before pulling or building anything: it needs an NVIDIA GPU host, and here "
          f"{'; '.join(found)}. Without them use {args.instead}.", file=sys.stderr)
    return EXIT_MISSING


if __name__ == "__main__":
    sys.exit(main())
