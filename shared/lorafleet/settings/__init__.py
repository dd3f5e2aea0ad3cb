"""The settings of each service, one section each over a common one, all read from the same environment.

Every field maps to the environment variable of its name in upper case, and every variable means the same thing in
every service that reads it. A service loads only its own section and the common one (`load_settings(ProxySettings)`
in the proxy), so a bad trainer setting cannot stop the proxy; the operations tools, which look at the whole stack,
load `StackSettings`, every section at once. The field's `description` is its documentation: the generated
docs/reference/settings.md (one table per section) and `.env.example` are checked against it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from dotenv import dotenv_values
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from lorafleet.settings.common import VLLM_LORA_RANKS, CommonSettings, ReplicaKey, round_lora_rank
from lorafleet.settings.proxy import ProxySettings
from lorafleet.settings.replica import AUTO_CPU_SETS, ReplicaSettings
from lorafleet.settings.trainer import TrainerSettings

__all__ = ["AUTO_CPU_SETS", "SECTIONS", "VLLM_LORA_RANKS", "CommonSettings", "ConfigError", "ProxySettings",
           "ReplicaSettings", "StackSettings", "TrainerSettings", "env_name", "gpus_shared", "load_settings",
           "round_lora_rank", "section_fields"]

ENV_FILE_VARIABLE = "LORAFLEET_ENV_FILE"
# Never echoed in error messages or logs.
SECRET_FIELDS = frozenset({"proxy_api_key", "proxy_upstream_token"})
# Variables that no longer exist, and what replaces them: refused at start rather than silently ignored.
RENAMED = {
    "PROXY_HOST": "PROXY_FLEET_HOST and PROXY_PUBLIC_HOST (one bind address per port)",
    "TRAINER_RECIPE": "TRAINER_TASK (the same names: math, jsonl, tiny; or a task file)",
}


class StackSettings(ProxySettings, ReplicaSettings, TrainerSettings):
    """Every section at once: what the operations tools (doctor, demo, docs) read; no service loads it."""


# The sections in the order the reference shows them, each with the fields it adds (a field belongs to one section;
# ReplicaKey's one field is shown with the replicas, which demand it).
SECTIONS: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("common", CommonSettings), ("replica", ReplicaSettings), ("proxy", ProxySettings), ("trainer", TrainerSettings))

Section = TypeVar("Section", bound=CommonSettings)


class ConfigError(ValueError):
    """A setting is invalid; the message names the environment variable."""


def section_fields(section: type[BaseSettings]) -> list[str]:
    """The fields `section` adds to the common ones (all of them for the common section), in schema order."""
    own = section.model_fields
    if section is CommonSettings:
        return list(own)
    inherited = set(CommonSettings.model_fields) | (set() if section is ReplicaSettings else
                                                    set(ReplicaKey.model_fields))
    return [name for name in own if name not in inherited]


def gpus_shared(settings: StackSettings) -> list[str]:
    """GPUs listed in both TRAINER_GPUS and VLLM_GPUS (on one box, a replica would claim a trainer GPU)."""
    return sorted(set(settings.trainer_gpu_list) & set(settings.gpu_pool), key=int)


def env_name(field: str) -> str:
    """The environment variable that sets `field`."""
    return field.upper()


def _refuse_renamed(env_file: str | None) -> None:
    in_file = dotenv_values(env_file) if env_file and Path(env_file).is_file() else {}
    stale = [name for name in RENAMED if name in os.environ or name in in_file]
    if stale:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(f"{name}: replaced by {RENAMED[name]}"
                                                                    for name in stale))


def load_settings(section: type[Section] = StackSettings, **overrides: object) -> Section:  # type: ignore[assignment]
    """Read one service's settings (`section`; every section by default), turning validation errors into one
    ConfigError that names each variable.

    The environment wins over `.env` in the working directory. LORAFLEET_ENV_FILE names another file,
    or none when empty (`make test` sets it empty, so a developer's stack `.env` cannot steer the tests).
    """
    env_file = os.environ.get(ENV_FILE_VARIABLE, ".env") or None
    _refuse_renamed(env_file)
    try:
        return section(_env_file=env_file, **overrides)  # type: ignore[call-arg]
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "settings"
            message = error["msg"].removeprefix("Value error, ")
            # Model-level errors carry every input as `input`, secrets included: show values of plain fields only.
            shown = "" if not error["loc"] or error["loc"][0] in SECRET_FIELDS else f" (got {error.get('input')!r})"
            problems.append(f"{env_name(where)}: {message}{shown}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None

