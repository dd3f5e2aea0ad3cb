"""Write a real PEFT LoRA adapter from a model's config.json alone: no weights read, no torch needed.

The one adapter writer of the project: the tiny model's test adapters (all linear layers, any rank)
and the doctor's probe adapter (rank 1 on one q_proj, for a model of any size) are both written
here. The files are PEFT's own format (`adapter_config.json` and `adapter_model.safetensors` with
PEFT's tensor names), so vLLM loads them at runtime and `PeftModel.from_pretrained` reads them.
The shapes follow Llama/Qwen2/Mistral-style decoders. Values are seeded and non-zero: PEFT's
default init (B = 0) would reproduce the base model and let a replica serving the base model pass.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# PEFT's "all-linear" on a Llama/Qwen2-style decoder: every linear layer but the output head.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """Module name -> (parent block, in_features, out_features) for one decoder layer."""
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads") or heads) * head_dim
    inner = int(text.get("intermediate_size") or 4 * hidden)
    return {
        "q_proj": ("self_attn", hidden, heads * head_dim), "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", heads * head_dim, hidden),
        "gate_proj": ("mlp", hidden, inner), "up_proj": ("mlp", hidden, inner), "down_proj": ("mlp", inner, hidden),
    }


def write_lora_adapter(out: Path, config: dict[str, Any], base_model: str, *, rank: int = 1,
                       alpha: int | None = None, modules: Sequence[str] = ALL_LINEAR,
                       layers: Sequence[int] | None = None, seed: int = 0, scale: float = 0.5,
                       b_scale: float | None = None, b_signs: bool = False) -> Path:
    """Write a LoRA adapter of `rank` on `modules` of `layers` (default: all) with N(0, scale) weights (B's
    N(0, b_scale) where given; with `b_signs`, exactly +-b_scale: a seed's adapters then differ only by B's size,
    as one run's versions a number of optimizer steps apart do).

    Published like TRL publishes: staged under a dot-name, then renamed into place, so a reader
    never sees half an adapter. `alpha` defaults to 2 * rank (the recipe's ratio).
    """
    b_scale = scale if b_scale is None else b_scale
    text = config.get("text_config") or config
    shapes = module_shapes(config)
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(int(text["num_hidden_layers"])) if layers is None else layers:
        for module in modules:
            block, fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = ([rank, fan_in], [rng.gauss(0, scale) for _ in range(rank * fan_in)])
            draws = (rng.gauss(0, 1) for _ in range(fan_out * rank))
            tensors[f"{prefix}.lora_B.weight"] = ([fan_out, rank], [b_scale * (math.copysign(1, z) if b_signs else z)
                                                                    for z in draws])
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": 2 * rank if alpha is None else alpha, "lora_dropout": 0.0, "target_modules": list(modules),
        "bias": "none", "modules_to_save": None, "use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
        "inference_mode": True,
    }
    stage = out.parent / f".{out.name}.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    (stage / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    (stage / "adapter_model.safetensors").write_bytes(_safetensors_f32(tensors))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(stage, out)
    return out


def _safetensors_f32(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """The safetensors format: u64 header length, JSON header (8-byte aligned), raw little-endian data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs)
