"""Which base model a local fleet (the demo) serves and trains, made ready before any process starts.

`tiny` is the offline random-weight model, built in seconds; a named model (lorafleet.named_models, e.g.
smollm2-135m) is converted once into MODEL_CACHE; anything else is passed on as BASE_MODEL takes it (a folder or a Hub
id). Unless told, the task picks: a task file's `defaults` may name its model, and its common settings (the model, the
LoRA rank, the context) reach every process, so that the replicas serve what the trainer trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorafleet.named_models import NAMED_MODELS
from lorafleet.settings import CommonSettings, env_name

TINY = "tiny"


def task_defaults(task: str) -> dict[str, Any]:
    """The task's `defaults` (read by the trainer's own loader, which checks them)."""
    from lorafleet_trainer.tasks.loader import read_task_settings

    return read_task_settings(task)[0].defaults


def common_env(defaults: dict[str, Any]) -> dict[str, str]:
    """The task's defaults every process must agree on (the common section), as environment variables; the model
    aside: `prepare` resolves it."""
    return {env_name(name): str(value) for name, value in defaults.items()
            if name in CommonSettings.model_fields and name != "base_model"}


def prepare(name: str, work: Path, say: Any = print) -> str:
    """BASE_MODEL for the fleet: the tiny model built under `work`, a named model's converted folder, or `name`."""
    if name == TINY:
        from lorafleet_ops.tiny_model import make_tiny_model

        say(f"==> building the offline tiny model in {work / TINY}")
        return str(make_tiny_model(work / TINY))
    if name in NAMED_MODELS:
        from lorafleet_ops.gguf_convert import env_cache, make_named_model

        cache = env_cache()
        say(f"==> the named model {name} in {cache} (converted from its wheel's GGUF on first use)")
        return str(make_named_model(name, cache))
    return name
