"""`math`: the published run, Qwen2.5-Math-1.5B on sail/Sanity-Test-R1D-1.5B (1,460 MATH problems).

Reward: the last `\\boxed{}` against the gold answer (normalised, math-verify fallback), 0 when truncated. With
DATASET_PATH set it reads a local copy of the set instead of the Hub (offline boxes). `EVAL_PROBLEMS` problems,
chosen by a fixed seed, are held out of training and scored as the eval set (a set of at most twice that many
trains on every problem and has no eval set).
"""

from __future__ import annotations

import functools
from typing import Any

from lorafleet.settings import TrainerSettings

from lorafleet_trainer.recipes import MATH_DATASET, load_local_dataset, to_prompt_rows
from lorafleet_trainer.rewards import boxed_answer_reward

EVAL_PROBLEMS = 64
EVAL_SEED = 1234
pass_threshold = 1.0


def math_task(dataset: Any, settings: TrainerSettings) -> dict[str, Any]:
    """Problem/solution rows as the task: the boxed-answer reward, `EVAL_PROBLEMS` held out (the same every run)."""
    reward = functools.partial(boxed_answer_reward, max_completion_length=settings.max_completion_length)
    if len(dataset) <= 2 * EVAL_PROBLEMS:
        return {"train_dataset": dataset, "reward_funcs": [reward]}
    parts = dataset.train_test_split(test_size=EVAL_PROBLEMS, seed=EVAL_SEED)
    return {"train_dataset": parts["train"], "eval_dataset": parts["test"], "reward_funcs": [reward]}


def build_task(tokenizer: Any, settings: TrainerSettings) -> dict[str, Any]:
    if settings.dataset_path:
        return math_task(to_prompt_rows(load_local_dataset(settings.dataset_path), settings.dataset_path), settings)
    from datasets import load_dataset

    return math_task(to_prompt_rows(load_dataset(MATH_DATASET, split="train"), MATH_DATASET), settings)
