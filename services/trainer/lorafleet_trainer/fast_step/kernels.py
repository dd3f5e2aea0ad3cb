"""The fused-kernel lever: Liger-Kernel's RMSNorm, SwiGLU and RoPE patched into the model (where installed).

Apart from the loss because it patches transformers' module classes, before the model is built or on a built one.
"""

from __future__ import annotations

import inspect
from typing import Any


def apply_liger(model_type: str, model: Any = None) -> str | None:
    """Patch Liger's RMSNorm, SwiGLU and RoPE into `model_type`'s modules (before the model is built), or into the
    built `model`'s modules.

    Returns None when applied, else why not (liger-kernel not installed, or no Liger patch for the architecture).
    Liger's cross-entropy heads stay off: TRL's chunked log-probability head computes the loss's log-probabilities.
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        return f"liger-kernel is not installed ({exc})"
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return f"Liger has no kernels for model type {model_type!r}"
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False}
    accepted = inspect.signature(apply).parameters
    if model is not None:
        wanted["model"] = model
    apply(**{key: value for key, value in wanted.items() if key in accepted})
    return None


def apply_liger_to_model(model: Any) -> None:
    """`apply_liger` on a built transformers model (its config names the architecture); raises if it cannot."""
    reason = apply_liger(model.config.model_type, model=model)
    if reason:
        raise RuntimeError(reason)
