"""LoRA layers as one autograd node: the rank-r update folded into the base product's epilogue.

PEFT computes an adapted layer as `base(x) + lora_B(lora_A(x)) * scaling`: at rank 1 the base product is the only
real matrix work, and the rest is memory traffic over the layer's whole output (the rank-r expansion written out,
scaled, then added), and in backward as much again over the output and the input (the scaled gradient, the rank-r
input gradient written out, then added to the base's). `FusedLoRALinear` computes the same sum with the update
accumulated into the base product in place (`addmm_`, C += s * (x A^T) B^T) and, in backward, the rank-r input
gradient accumulated into the base's (`addmm_`): two GEMMs and two thin products per direction, no elementwise
passes. The values are the same sum, rounded once instead of three times under bf16. Only plain LoRA layers are
fused (one active adapter, nn.Linear base, no dropout, DoRA or other variant, not merged); every other layer, and
every call with extra arguments, runs PEFT's own forward. Measured by `make bench-trainer` (`fused-lora`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class FusedLoRALinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T, with x (N, d), W (out, d), A (r, d), B (out, r), all of one dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        xa = torch.mm(x, lora_a.t())
        out.addmm_(xa, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, xa)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b, xa = ctx.saved_tensors
        needs_x, needs_w, needs_bias, needs_a, needs_b, _ = ctx.needs_input_grad
        scaling = ctx.scaling
        grad = grad.contiguous()
        grad_xa = torch.mm(grad, lora_b).mul_(scaling)  # (N, r): the gradient reaching x A^T
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if needs_x:
            grad_x = torch.mm(grad, weight)
            grad_x.addmm_(grad_xa, lora_a)
        if needs_a:
            grad_a = torch.mm(grad_xa.t(), x)
        if needs_b:
            grad_b = torch.mm(grad.t(), xa).mul_(scaling)
        if needs_w:
            grad_w = torch.mm(grad.t(), x)
        if needs_bias and ctx.has_bias:
            grad_bias = grad.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def _plain_adapter(layer: Any) -> str | None:
    """The one adapter `layer` can fuse, or None when PEFT's forward must run (checked on every call: cheap)."""
    if layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    adapter = active[0]
    if adapter not in layer.lora_A or adapter in getattr(layer, "lora_variant", {}):
        return None
    if not isinstance(layer.lora_dropout[adapter], nn.Identity) or getattr(layer, "lora_bias", {}).get(adapter):
        return None
    return adapter


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    adapter = None if args or kwargs else _plain_adapter(self)
    if adapter is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    # The casts autocast would make, outside the node: the adapter's weights stay float32 and get float32 gradients.
    weight = base.weight.to(dtype)
    bias = base.bias.to(dtype) if base.bias is not None else None
    lora_a = self.lora_A[adapter].weight.to(dtype)
    lora_b = self.lora_B[adapter].weight.to(dtype)
    flat = x.to(dtype).reshape(-1, x.shape[-1])
    with torch.autocast(device, enabled=False):
        out = FusedLoRALinear.apply(flat, weight, bias, lora_a, lora_b, float(self.scaling[adapter]))
    return out.view(*x.shape[:-1], out.shape[-1])


def fuse_lora_layers(model: nn.Module) -> int:
    """Route every plain PEFT LoRA Linear of `model` through `FusedLoRALinear`; returns how many layers."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and isinstance(module.base_layer, nn.Linear):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


def unfuse_lora_layers(model: nn.Module) -> None:
    """Undo `fuse_lora_layers` (PEFT's own forward again)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), types.MethodType) and module.forward.__func__ is _fused_forward:
            del module.forward
