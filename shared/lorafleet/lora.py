"""The trainer's LoRA shape and TRL's adapter-sync decision, shared by the trainer and the doctor.

Both must agree on what the trainer will publish (its LoraConfig) and on whether TRL will sync
adapters only (it falls back to merged-weight sync, which behind a proxy reaches one replica only):
one definition here, so the doctor judges exactly what the trainer runs.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from lorafleet.settings import CommonSettings


def build_lora_config(settings: CommonSettings) -> Any:
    """The trainer's PEFT LoraConfig as the settings define it (rank, alpha, all-linear)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules="all-linear",
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def adapter_rank(settings: CommonSettings, peft_config: Any = None) -> int:
    """The rank vLLM must serve: PEFT's `r` raised by any `rank_pattern` entry, else LORA_RANK."""
    if peft_config is None:
        return settings.lora_rank
    return max([int(peft_config.r), *(int(value) for value in (peft_config.rank_pattern or {}).values())])


def trl_select_adapter_sync(
    server_config: dict[str, Any], lora_config: Any, max_staleness: int
) -> tuple[bool, list[str]]:
    """Run TRL's `select_adapter_sync` on `server_config`; return its decision and the warnings it logged.

    The model is a stand-in with the two attributes TRL reads (`active_adapters`, `peft_config`), so
    no weights are loaded. accelerate's logger needs an accelerate state, hence `PartialState()`.
    """
    from types import SimpleNamespace

    from accelerate import PartialState
    # lorafleet pins TRL 1.16, whose AsyncGRPOTrainer lives in trl.experimental: the warning tells us nothing.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import async_grpo_trainer

    PartialState()
    stand_in = SimpleNamespace(active_adapters=["default"], peft_config={"default": lora_config})
    warnings: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(re.sub(r"^\[RANK \d+\] ", "", record.getMessage()))  # accelerate's prefix

    trl_logger = logging.getLogger(async_grpo_trainer.__name__)
    collector = _Collect()
    trl_logger.addHandler(collector)
    try:
        decided = async_grpo_trainer.select_adapter_sync(server_config, stand_in,
                                                         SimpleNamespace(max_staleness=max_staleness))
    finally:
        trl_logger.removeHandler(collector)
    return bool(decided), warnings
