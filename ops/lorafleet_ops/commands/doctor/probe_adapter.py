"""The probe adapter: a rank-1 LoRA on one q_proj of the served base model, written under the adapter root.

Shapes come from the base model's config.json alone (a local directory, the Hugging Face cache or
the Hub), so the probe costs a few KB for a model of any size; the writer is the project's one
adapter writer (`lorafleet_ops.peft_adapter`). vLLM accepts a subset of its LoRA target modules, so
q_proj alone loads on every Llama/Qwen/Mistral-style model.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorafleet.adapters import lora_dir
from lorafleet.settings import StackSettings

from lorafleet_ops.peft_adapter import write_lora_adapter

PROBE_PREFIX = "lorafleet-doctor-probe"
PROBE_SCALE = 0.03  # small weights: the probe must load and generate, not change what it generates much


def base_model_config(candidates: Sequence[str]) -> dict[str, Any]:
    """config.json of the served base model: a local directory, else the Hugging Face cache (or Hub)."""
    for candidate in candidates:
        path = Path(candidate, "config.json")
        if path.is_file():
            return json.loads(path.read_text())
    errors = []
    for candidate in candidates:
        if Path(candidate).is_absolute():
            continue
        try:
            from huggingface_hub import hf_hub_download

            return json.loads(Path(hf_hub_download(candidate, "config.json")).read_text())
        except Exception as exc:  # any Hub/cache failure: try the next candidate, report all
            errors.append(f"{candidate}: {type(exc).__name__}: {exc}")
    raise FileNotFoundError("no config.json for the base model (" + "; ".join(errors or list(candidates)) + ")")


def publish_probe_adapter(settings: StackSettings, config: dict[str, Any], base_model: str) -> tuple[str, Path]:
    """Write a fresh probe adapter for `base_model` (its `config`) under this run's LoRA directory.

    Returns its name and directory; raises OSError when the adapter root is not writable here and
    KeyError/ValueError when the config lacks the decoder's shapes.
    """
    name = f"{PROBE_PREFIX}-{secrets.token_hex(4)}"
    directory = lora_dir(settings.adapter_root, settings.run_name) / name
    write_lora_adapter(directory, config, base_model, rank=1, alpha=1, modules=("q_proj",), layers=(0,),
                       scale=PROBE_SCALE)
    return name, directory
