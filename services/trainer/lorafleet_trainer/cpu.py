"""Run TRL 1.16's AsyncGRPOTrainer without CUDA, for real: the CPU demo and the integration tests.

TRL trains through a FlashAttention-3 varlen kernel fetched from the Hub on the first forward
(`packing._flash_attn()`), and asks CUDA for the device's peak FLOPs in the trainer's `__init__`.
Neither exists on a CPU box. `install_cpu_support()` puts a pure-PyTorch kernel with the same
semantics where TRL looks the kernel up, and turns the MFU metrics off; nothing else changes.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def _visible_keys(q_len: int, k_len: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """(q_len, k_len) bool mask aligned bottom-right: query i sees key j in [i+d-left, i+d+right], d = k_len - q_len.

    A negative bound is unbounded; causal attention is right = 0.
    """
    diagonal = torch.arange(k_len, device=device).unsqueeze(0) - torch.arange(q_len, device=device).unsqueeze(1)
    diagonal -= k_len - q_len
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= diagonal <= right
    if left >= 0:
        visible &= diagonal >= -left
    return visible


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **_: object,
) -> torch.Tensor:
    """FlashAttention's varlen attention in plain PyTorch (differentiable, any device).

    q is (total_q, Hq, D), k and v are (total_k, Hk, D) with Hq a multiple of Hk (GQA); segment s
    is q[cu_seqlens_q[s]:cu_seqlens_q[s+1]] against k/v[cu_seqlens_k[s]:cu_seqlens_k[s+1]]. With
    `causal`, the mask is aligned bottom-right as in FlashAttention >= 2.1, which is what tree
    attention relies on: a segment's queries are the last positions of its root-to-segment path.
    The softmax runs in float32; a query that sees no key gets zeros. Returns (total_q, Hq, D).
    """
    heads_q, heads_k = q.shape[1], k.shape[1]
    if heads_q % heads_k:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_k})")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = window_size if window_size else (-1, -1)
    if causal:
        right = 0
    out = torch.zeros_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for segment in range(len(bounds_q) - 1):
        q0, q1 = bounds_q[segment], bounds_q[segment + 1]
        k0, k1 = bounds_k[segment], bounds_k[segment + 1]
        if q1 <= q0:
            continue
        qs = q[q0:q1].transpose(0, 1).float()  # (Hq, Lq, D)
        ks = k[k0:k1].transpose(0, 1).float().repeat_interleave(heads_q // heads_k, dim=0)
        vs = v[k0:k1].transpose(0, 1).float().repeat_interleave(heads_q // heads_k, dim=0)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # (Hq, Lq, Lk)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if left >= 0 or right >= 0:
            scores = scores.masked_fill(~_visible_keys(q1 - q0, k1 - k0, left, right, q.device), float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[q0:q1] = torch.matmul(weights, vs).transpose(0, 1).to(q.dtype)
    return out


def _this_module() -> ModuleType:
    """Stand-in for TRL's `packing._flash_attn()`: an object whose `flash_attn_varlen_func` is ours."""
    return sys.modules[__name__]


def _no_peak_flops(_accelerator: object, _dtype: str) -> None:
    """CPUs have no peak-FLOPs entry: MFU metrics are off, throughput and timings still logged."""
    return None


def install_torch_attention() -> None:
    """Make TRL's tree attention use `flash_attn_varlen_func` above instead of the Hub's FA3 kernel.

    Idempotent; in the training process only (the rollout child never runs attention). Also the way
    to train on a GPU the FA3 kernel does not support, at the cost of speed.
    """
    from trl.experimental.async_grpo import packing

    packing._flash_attn = _this_module
    log.info("pure-PyTorch varlen attention kernel installed in place of FA3")


def install_cpu_support(threads: int = 0) -> None:
    """Make TRL's AsyncGRPOTrainer train on CPU: our attention kernel, no CUDA peak-FLOPs query.

    `threads` > 0 caps torch's threads: next to vLLM replicas on the same cores, OpenMP spinning
    on busy cores made a step ~5x slower than one thread.
    """
    from trl.experimental.async_grpo import async_grpo_trainer

    install_torch_attention()
    async_grpo_trainer.get_peak_flops_per_device = _no_peak_flops
    if threads:
        torch.set_num_threads(threads)
    log.info("CPU mode: MFU metrics off", extra={"fields": {"torch_threads": torch.get_num_threads()}})
