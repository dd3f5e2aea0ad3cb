"""The section every service reads: the model, the adapter store, the run and its policy versions, logging.

These are the values that must agree across the trainer, the replicas and the proxy (MAX_STALENESS, LORA_RANK,
ADAPTER_ROOT...), so they live in one section that every service's settings class inherits; values derived from
several of them (`max_loras`, `max_lora_rank`) are computed here and nowhere else.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, computed_field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorafleet.adapters import metrics_path, run_dir
from lorafleet.named_models import DEFAULT_MODEL_CACHE, NAMED_MODELS, resolve_base_model
from lorafleet.runs import RUN_NAME_DEFAULT, run_slots, slot_budget

# vLLM accepts only these values for --max-lora-rank (vllm/config/lora.py, TRL's VLLM_LORA_RANKS).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def round_lora_rank(rank: int) -> int:
    """Smallest rank vLLM accepts for --max-lora-rank that still serves an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")


def csv_items(value: str, sep: str = ",") -> list[str]:
    """The non-empty items of a `sep`-separated list, stripped."""
    return [item.strip() for item in value.split(sep) if item.strip()]


def check_gpu_ids(value: str) -> str:
    """A GPU list setting (VLLM_GPUS, TRAINER_GPUS): distinct indices separated by commas."""
    ids = csv_items(value)
    if not ids or not all(item.isdigit() for item in ids) or len(set(ids)) != len(ids):
        raise ValueError("must be distinct GPU indices separated by commas, e.g. 0,1,2")
    return value


def check_urls(value: str) -> str:
    """A URL setting (PROXY_UPSTREAMS, TRAINER_VLLM_URL): each comma-separated item an http(s) URL."""
    for url in csv_items(value):
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"{url!r} is not an http(s) URL")
    return value


class CommonSettings(BaseSettings):
    """Every service: the model, the adapter store, the run and its policy versions."""

    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True)

    model_cache: Path = Field(
        DEFAULT_MODEL_CACHE,
        description="Where named models (BASE_MODEL=" + ", ".join(NAMED_MODELS) + ") are converted once and read.",
    )
    base_model: str = Field(
        "Qwen/Qwen2.5-Math-1.5B",
        description="Base model served by every replica and trained by the trainer (Hub id, local directory, or a "
        "named model converted into MODEL_CACHE: " + ", ".join(NAMED_MODELS) + ").",
    )
    adapter_root: Path = Field(
        Path("/adapters"),
        description="Shared adapter volume, mounted at this same absolute path in every service.",
    )
    run_name: str = Field(
        RUN_NAME_DEFAULT, description="Run folder under ADAPTER_ROOT/runs/ for adapters and checkpoints."
    )
    lora_rank: int = Field(1, ge=1, description="LoRA rank r of the trained adapter (<= 512).")
    lora_alpha: int = Field(2, ge=1, description="LoRA alpha (scaling = alpha / r).")
    max_staleness: int = Field(
        4, ge=0, description="Policy versions a rollout may lag behind; replicas get max_staleness + 2 LoRA slots."
    )
    fleet_max_runs: int = Field(
        1, ge=1, description="Training runs the fleet serves at once: replicas get "
        "FLEET_MAX_RUNS x (MAX_STALENESS + 2) LoRA slots, the proxy's slot budget.",
    )
    weight_sync_steps: int = Field(4, ge=1, description="Optimizer steps between adapter publications.")
    max_model_len: int = Field(4096, ge=16, description="Context length served by the replicas (prompt + completion).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level of every service.")

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_folder_name(cls, value: str) -> str:
        if not RUN_NAME_PATTERN.match(value):
            raise ValueError(f"must match {RUN_NAME_PATTERN.pattern} (a plain folder name)")
        return value

    @field_validator("base_model")
    @classmethod
    def _named_model_is_its_folder(cls, value: str, info: ValidationInfo) -> str:
        return resolve_base_model(value, info.data.get("model_cache", DEFAULT_MODEL_CACHE))

    @field_validator("adapter_root")
    @classmethod
    def _adapter_root_is_absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path (replicas must see adapters at the same path)")
        return value

    @field_validator("lora_rank")
    @classmethod
    def _rank_is_servable(cls, value: int) -> int:
        round_lora_rank(value)
        return value

    # --- derived values: computed here, used everywhere ---------------------------------------
    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def max_loras(self) -> int:
        """LoRA slots per replica: max_staleness + 1 versions can be in flight, and a sync loads before it unloads;
        once per run the fleet serves at once."""
        return slot_budget(self.fleet_max_runs, self.max_staleness)

    @property
    def run_slots(self) -> int:
        """LoRA slots one run of this staleness reserves on every replica."""
        return run_slots(self.max_staleness)

    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def max_lora_rank(self) -> int:
        """--max-lora-rank for the replicas: the adapter rank rounded up to a value vLLM accepts."""
        return round_lora_rank(self.lora_rank)

    @property
    def run_dir(self) -> Path:
        return run_dir(self.adapter_root, self.run_name)

    @property
    def metrics_path(self) -> Path:
        return metrics_path(self.adapter_root, self.run_name)


class ReplicaKey(BaseSettings):
    """The replicas' API key, which the replicas demand and the proxy (and the doctor) send: one field, two sections."""

    proxy_upstream_token: str = Field(
        "", description="Replicas' Bearer key (their vLLM API key); proxy and doctor send it. Empty = none. SECRET."
    )
