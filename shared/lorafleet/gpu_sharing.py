"""How vLLM replicas share a GPU's memory: the memory fraction (VLLM_GPU_MEMORY_UTILIZATION) at which N replicas
started one after the other pass vLLM's start-up rule and still fit, and how many replicas one GPU holds at a given
fraction. The replica (which GPU to claim, whether its GPU has room) and the process launcher's placement
(lorafleet_ops.placement) both read it here, so they cannot disagree.

vLLM's accounting (vllm/v1/worker/utils.py, request_memory; the same in 0.26 and 0.31): an engine refuses to start
unless the free memory it finds is at least its fraction of the card's total; its fraction then covers its weights,
activations and KV cache, but not its CUDA context and non-torch memory, which it holds on top. Measured on an H100
80GB (bench-gpu, 2026-12-07): a fresh card showed 78.66 of 79.18 GiB free (nvidia-smi's total: 79.65), and an engine
asked for 37.61 GiB took 39.08. So a card holds its driver's share, every engine's fraction plus overhead, and
whatever other processes (a trainer) take: the fraction is what is left, split between the replicas.
"""

from __future__ import annotations

import math

# A fresh card's memory that no process can have (nvidia-smi's total less what CUDA reports free): 0.99 GiB on an
# H100 80GB; rounded up.
DRIVER_RESERVED_GIB = 1.0
# What a started engine holds beyond its fraction (CUDA context, non-torch memory, NCCL and sampler buffers): 1.47 GiB
# measured for a 1.5B model on an H100; with margin for CUDA graphs' private pools and larger vocabularies.
ENGINE_OVERHEAD_GIB = 2.0
# The card the fraction is planned for where none is named: the smallest the GPU tier runs on, an H100 80GB
# (nvidia-smi's total).
REFERENCE_CARD_GIB = 81559 / 1024
# All the vLLM replicas of one GPU together, plus the trainer's reserve where it shares the GPU, take at most this
# share of its memory (how many claims a GPU offers).
MEMORY_BUDGET = 0.95
MIN_FRACTION = 0.01  # below it a replica has no room for weights and a KV cache


def fitting_fraction(replicas: int, card_gib: float = REFERENCE_CARD_GIB, reserved: float = 0.0) -> float:
    """The largest fraction (rounded down to 3 decimals) at which `replicas` engines started one after the other on
    one card of `card_gib` (nvidia-smi's total) each find their fraction free and all fit, beside other processes
    holding `reserved` of the card (a trainer's share)."""
    overhead = (DRIVER_RESERVED_GIB + replicas * ENGINE_OVERHEAD_GIB) / card_gib
    return math.floor(1000 * (1.0 - reserved - overhead) / replicas + 1e-9) / 1000


def gpu_shares(fraction: float) -> int:
    """How many replicas one GPU holds when each takes `fraction` of its memory (at least one)."""
    return max(1, math.floor(MEMORY_BUDGET / fraction + 1e-9))
