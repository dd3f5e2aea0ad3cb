"""Training attention backends for TRL's tree attention, and the choice between them.

TRL 1.16's AsyncGRPOTrainer packs a micro-batch into a prefix trie and runs attention through
`packing._flash_attn().flash_attn_varlen_func(...)`, a FlashAttention-3 varlen kernel that the
`kernels` package downloads from the Hub on first use. Three backends can stand behind that name:

- `fa3`: the Hub kernel itself (fastest; needs Hub access and a GPU that kernel supports).
- `builtin`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (FlashAttention compiled into
  torch >= 2.10, no download); `builtin_varlen_func` maps FlashAttention's arguments onto it.
- `torch`: `torch_varlen_func`, a pure-PyTorch loop over segments (any device, float32 included;
  what CPU training uses; ~15x slower than `builtin` on an H200).

`auto` picks `fa3` on a GPU when the Hub kernel can be had, else `builtin`, else `torch`; on CPU
always `torch`. This module imports only torch at load time, so the GPU kernel tests and the timing
script run on a machine with PyTorch but no TRL.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from lorafleet_trainer import trl_seam

log = logging.getLogger(__name__)

BACKENDS = ("fa3", "builtin", "torch")
HALF_DTYPES = (torch.float16, torch.bfloat16)
# FlashAttention keyword arguments the built-in kernel can honour only at these (default) values.
NEUTRAL_KWARGS: dict[str, Any] = {"dropout_p": 0.0, "alibi_slopes": None, "return_attn_probs": False,
                                  "deterministic": False, "block_table": None}


class UnsupportedAttention(ValueError):
    """An attention call or a backend choice that the selected kernel cannot honour."""


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


def _window(causal: bool, window_size: tuple[int, int] | None) -> tuple[int, int]:
    """FlashAttention's (left, right) key window; `causal` forces right = 0. -1 = unbounded."""
    left, right = window_size if window_size else (-1, -1)
    return (left, 0) if causal else (left, right)


def torch_varlen_func(
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
    """FlashAttention's varlen attention in plain PyTorch (differentiable, any device and dtype).

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
    left, right = _window(causal, window_size)
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


def torch_varlen_attn() -> Callable[..., Any] | None:
    """PyTorch's built-in varlen FlashAttention (torch >= 2.10), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _parameters(kernel: Callable[..., Any]) -> frozenset[str]:
    """The keyword names `kernel` takes, read once: the call runs per layer and micro-batch, on the critical path."""
    return frozenset(inspect.signature(kernel).parameters)


def _max_len(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0


def builtin_varlen_func(
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
    *,
    kernel: Callable[..., Any] | None = None,
    **extra: object,
) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` signature on top of torch's `varlen_attn`.

    Causal masks and windows keep FlashAttention's bottom-right alignment (torch's kernel is
    FlashAttention underneath). GQA goes to the kernel where it takes `enable_gqa`, else the
    key/value heads are repeated. What the kernel cannot honour raises `UnsupportedAttention`
    rather than computing something else: a softcap, dropout, ALiBi, float32 inputs, CPU tensors,
    and (on torch versions whose kernel has only `is_causal`) sliding windows. `kernel` replaces
    torch's function in tests.
    """
    varlen_attn = kernel or torch_varlen_attn()
    if varlen_attn is None:
        raise UnsupportedAttention(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                                   "(torch >= 2.10 has it); use TRAINER_ATTENTION=torch or fa3")
    odd = {key: value for key, value in extra.items()
           if key not in NEUTRAL_KWARGS or value != NEUTRAL_KWARGS[key]}
    if odd:
        raise UnsupportedAttention(f"the built-in varlen kernel cannot honour {sorted(odd)}; "
                                   "use TRAINER_ATTENTION=torch or fa3")
    if softcap:
        raise UnsupportedAttention(f"the built-in varlen kernel has no logit softcap (softcap={softcap}); "
                                   "use TRAINER_ATTENTION=torch or fa3")
    if q.dtype not in HALF_DTYPES:
        raise UnsupportedAttention(f"the built-in varlen kernel runs in float16/bfloat16, not {q.dtype}; train with "
                                   "bf16 mixed precision (TRAINER_PRECISION=auto or bf16) or TRAINER_ATTENTION=torch")
    if kernel is None and q.device.type != "cuda":
        raise UnsupportedAttention(f"the built-in varlen kernel needs CUDA tensors, not {q.device.type}")
    heads_q, heads_k = q.shape[1], k.shape[1]
    if heads_q % heads_k:
        raise UnsupportedAttention(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_k})")
    left, right = _window(causal, window_size)
    accepts = _parameters(varlen_attn)
    options: dict[str, Any] = {"scale": softmax_scale}
    if "window_size" in accepts:
        options["window_size"] = (left, right)
    elif (left, right) == (-1, 0) or (left, right) == (-1, -1):
        options["is_causal"] = (left, right) == (-1, 0)
    else:
        raise UnsupportedAttention(f"torch {torch.__version__}'s varlen kernel has no window_size (asked for "
                                   f"{(left, right)}); use TRAINER_ATTENTION=torch or fa3")
    if heads_q != heads_k:
        if "enable_gqa" in accepts:
            options["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads_q // heads_k, dim=1)
            v = v.repeat_interleave(heads_q // heads_k, dim=1)
    out = varlen_attn(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
        max_seqlen_q if max_seqlen_q is not None else _max_len(cu_seqlens_q),
        max_seqlen_k if max_seqlen_k is not None else _max_len(cu_seqlens_k),
        **options,
    )
    return out[0] if isinstance(out, tuple) else out


KERNELS: dict[str, Callable[..., torch.Tensor]] = {"builtin": builtin_varlen_func, "torch": torch_varlen_func}


@dataclass(frozen=True)
class Choice:
    """The backend the trainer uses and, for the log line, why."""

    backend: str
    reason: str


def hub_kernel() -> Any:
    """The kernel TRL would use: its `packing._flash_attn()`, which fetches FA3 from the Hub (cached)."""
    from trl.experimental.async_grpo import packing

    return packing._flash_attn()


def choose_backend(requested: str, *, cuda: bool, fetch_hub: Callable[[], Any] = hub_kernel,
                   builtin: Callable[[], Callable[..., Any] | None] = torch_varlen_attn) -> Choice:
    """Resolve TRAINER_ATTENTION (auto, fa3, builtin, torch) to a backend on this machine.

    A forced GPU backend that cannot work here is an `UnsupportedAttention` naming the setting, at
    start-up, rather than a failure on the first forward pass.
    """
    if requested not in ("auto", *BACKENDS):
        raise UnsupportedAttention(f"TRAINER_ATTENTION={requested!r}: expected auto, {', '.join(BACKENDS)}")
    if requested == "torch":
        return Choice("torch", "TRAINER_ATTENTION=torch")
    if not cuda:
        if requested != "auto":
            raise UnsupportedAttention(f"TRAINER_ATTENTION={requested} needs a CUDA GPU; this trainer has none "
                                       "(use auto or torch)")
        return Choice("torch", "no CUDA device: the pure-PyTorch kernel")
    hub_error = ""
    if requested in ("auto", "fa3"):
        try:
            fetch_hub()
        except Exception as exc:  # any failure to fetch or load the kernel means: not available here
            hub_error = f"{type(exc).__name__}: {exc}"
            if requested == "fa3":
                raise UnsupportedAttention(f"TRAINER_ATTENTION=fa3: the Hub's FlashAttention kernel cannot be "
                                           f"loaded ({hub_error}); use auto or builtin") from exc
        else:
            return Choice("fa3", "the Hub's FlashAttention-3 kernel loaded" if requested == "auto"
                          else "TRAINER_ATTENTION=fa3")
    if builtin() is not None:
        return Choice("builtin", "TRAINER_ATTENTION=builtin" if requested == "builtin"
                      else f"the Hub's FlashAttention kernel is unavailable ({hub_error}): torch's built-in varlen "
                      "FlashAttention instead")
    if requested == "builtin":
        raise UnsupportedAttention(f"TRAINER_ATTENTION=builtin: torch {torch.__version__} has no "
                                   "torch.nn.attention.varlen.varlen_attn (torch >= 2.10); use auto or torch")
    return Choice("torch", f"the Hub's FlashAttention kernel is unavailable ({hub_error}) and torch "
                  f"{torch.__version__} has no built-in varlen kernel: the pure-PyTorch kernel (slow on GPU)")


def install(backend: str) -> None:
    """Put `backend`'s kernel where TRL's tree attention looks it up (`fa3` leaves TRL's own in place).

    Idempotent; in the training process only (the rollout child never runs attention).
    """
    if backend == "fa3":
        return
    kernel = SimpleNamespace(flash_attn_varlen_func=KERNELS[backend])
    trl_seam.set_attention_kernel(lambda: kernel)
    log.info("attention kernel installed in place of FA3", extra={"fields": {"backend": backend}})
