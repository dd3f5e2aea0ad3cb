"""How many vLLM replicas one GPU holds at a given VLLM_GPU_MEMORY_UTILIZATION: the replica (which GPU to claim)
and the process launcher's placement (lorafleet_ops.placement) both read it here, so the two cannot disagree."""

from __future__ import annotations

import math

# All the vLLM replicas of one GPU together, plus the trainer's reserve where it shares the GPU, take at most this
# share of its memory: the CUDA contexts and the driver need the rest, and vLLM refuses to start when the free
# memory it finds is below its fraction (vllm/v1/worker/utils.py, request_memory).
MEMORY_BUDGET = 0.95
MIN_FRACTION = 0.01  # below it a replica has no room for weights and a KV cache


def gpu_shares(fraction: float) -> int:
    """How many replicas one GPU holds when each takes `fraction` of its memory (at least one)."""
    return max(1, math.floor(MEMORY_BUDGET / fraction + 1e-9))
