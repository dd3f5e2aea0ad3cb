"""The run's outputs beside its checkpoints (checkpoints.py): metrics.jsonl and the final adapter export."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from lorafleet.logs import log_event
from transformers import TrainerCallback

from lorafleet_trainer.checkpoints import FINAL_ADAPTER, replace_whole

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# The per-step numbers worth one log line (the full dict goes to metrics.jsonl).
STEP_LOG_KEYS = ("reward", "ratio", "kl", "perf/step_s", "perf/weight_sync_s", "sample/staleness_mean",
                 "sample/dropped_stale_total", "perf/rollout_wait_s")


class MetricsJsonl(TrainerCallback):
    """Append every logged metric dict as one JSON line `{"step", "time", **logs}` (read by status and doctor).

    Also logs one short structured line per step, in place of transformers' printed dict.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not logs or not state.is_world_process_zero:
            return
        self.append(state.global_step, logs)
        shown = {
            key.split("/")[-1]: round(value, 4) for key in STEP_LOG_KEYS if isinstance(value := logs.get(key), float)
        }
        log_event(log, "train_step", step=state.global_step, **shown)

    def append(self, step: int, values: dict[str, Any]) -> None:
        """One line `{"step", "time", **values}` (one write: lines from two threads never interleave)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({key: _jsonable(value) for key, value in values.items()})
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def export_final_adapter(trainer: Any, run_dir: Path) -> Path | None:
    """Save the trained adapter to <run>/final-adapter, replacing an older one whole; a collective: every rank calls it.

    TRL's own adapter writer (the one every published version goes through) gathers FSDP2-sharded LoRA tensors with
    `full_tensor()` on every rank and writes plain tensors on rank 0; PEFT's `save_pretrained` on the sharded model
    would hand DTensors to safetensors and fail. Returns the folder on the main process, None on the others.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter

    accelerator = trainer.accelerator
    model = accelerator.unwrap_model(trainer.model)
    target = run_dir / FINAL_ADAPTER
    staged = run_dir / f".{FINAL_ADAPTER}.new"
    save_lora_adapter(model, accelerator, model.active_adapters[0], str(staged))
    if not accelerator.is_main_process:
        return None
    return replace_whole(staged, target)


