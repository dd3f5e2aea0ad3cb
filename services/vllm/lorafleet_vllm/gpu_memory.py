"""Whether the claimed GPU has the memory this replica's fraction asks for, before vLLM is started.

vLLM refuses to start when the free memory it finds is below VLLM_GPU_MEMORY_UTILIZATION of the card (its start-up
rule, lorafleet.gpu_sharing), but only after a minute of loading, and in words that name its own flag. The replica
asks nvidia-smi first and stops at once with one line that names the setting, the free memory it saw and the most it
could ask for now. Where nvidia-smi cannot answer, vLLM's own check stands.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

FRACTION_VARIABLE = "VLLM_GPU_MEMORY_UTILIZATION"
QUERY = ["nvidia-smi", "--query-gpu=index,memory.free,memory.total", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class GpuMemory:
    index: int
    free_mib: int
    total_mib: int


class NotEnoughGpuMemory(RuntimeError):
    """The GPU's free memory is below what the fraction asks for; the message says what to change."""


def query_nvidia_smi() -> list[GpuMemory]:
    """Every GPU nvidia-smi lists, with its free and total memory (OSError or CalledProcessError where it cannot)."""
    output = subprocess.run(QUERY, capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [line.split(",") for line in output.splitlines() if line.strip()]
    return [GpuMemory(int(index), int(free), int(total)) for index, free, total in rows]


def check_room(device: str | None, fraction: float,
               query: Callable[[], list[GpuMemory]] = query_nvidia_smi) -> GpuMemory:
    """The GPU `device` names (a host index; None: the first the runtime shows, as under a scheduler) has at least
    `fraction` of its memory free; raises NotEnoughGpuMemory naming the setting, else returns what it saw."""
    gpus = query()
    gpu = next((gpu for gpu in gpus if device is None or str(gpu.index) == device), None)
    if gpu is None:
        raise NotEnoughGpuMemory(f"nvidia-smi lists no GPU {device} (it lists "
                                 f"{', '.join(str(gpu.index) for gpu in gpus) or 'none'})")
    wanted_mib = fraction * gpu.total_mib
    if gpu.free_mib < wanted_mib:
        most = math.floor(1000 * gpu.free_mib / gpu.total_mib) / 1000
        raise NotEnoughGpuMemory(
            f"GPU {gpu.index} has {gpu.free_mib / 1024:.2f} GiB free of {gpu.total_mib / 1024:.2f} GiB, less than "
            f"{FRACTION_VARIABLE}={fraction} asks for ({wanted_mib / 1024:.2f} GiB), so vLLM would refuse to start: "
            f"set {FRACTION_VARIABLE} to at most {most} (what is free now), stop what holds the GPU, or give this "
            "replica a GPU of its own")
    return gpu
