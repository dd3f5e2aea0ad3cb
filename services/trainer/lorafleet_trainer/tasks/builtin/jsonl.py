"""`jsonl`: the math task on a local JSONL/Parquet file (DATASET_PATH, required) with problem/solution columns."""

from __future__ import annotations

from typing import Any

from lorafleet.settings import TrainerSettings

from lorafleet_trainer.recipes import load_local_dataset, to_prompt_rows
from lorafleet_trainer.tasks.builtin.math import math_task

pass_threshold = 1.0


def build_task(tokenizer: Any, settings: TrainerSettings) -> dict[str, Any]:
    return math_task(to_prompt_rows(load_local_dataset(settings.dataset_path), settings.dataset_path), settings)
