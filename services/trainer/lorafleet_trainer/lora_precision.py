"""LoRA layers under bf16 autocast without PEFT's float32 copies of their inputs.

PEFT keeps the adapter's weights in float32 (the optimizer steps them there) and, by default, casts each LoRA
layer's input to its weights' dtype before the low-rank product: under bf16 mixed precision that is a float32 copy
of every adapted layer's activation (7 per decoder layer, up to 16k x 8960 values for `down_proj`), which autocast
then casts back to bf16 for the matmul, and the same again in backward. With the cast off, autocast casts the
rank-r weights instead (a few KB) and the products read the bf16 activation the base layer already holds; the
adapter's weights, gradients and optimizer state stay float32. Measured on an H200 by `make bench-trainer`.
"""

from __future__ import annotations

from typing import Any


def autocast_adapter_inputs(model: Any) -> int:
    """Turn PEFT's input cast off on every LoRA layer of `model` (only under autocast); returns how many layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)
