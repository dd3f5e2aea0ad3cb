"""`tiny`: the offline tiny model (`lorafleet make-tiny-model`) on a synthetic task a rank-1 adapter learns fast.

The reward is the share of generated tokens in the row's target set (`tiny_targets`); 2 CPU cores raise it within
minutes. The defaults: 4 groups of 8 rollouts of 4 tokens per step (short completions keep GRPO's per-completion
credit close to per-token), a sync every step, a short queue so samples stay fresh, a learning rate a rank-1
adapter moves visibly with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafleet.settings import ConfigError, TrainerSettings
from lorafleet.tiny_vocabulary import MODEL_MARKER

from lorafleet_trainer.recipes import tiny_dataset, tiny_targets
from lorafleet_trainer.rewards import target_token_reward

EVAL_PROMPTS = 16
pass_threshold = 0.5  # half of the generated tokens in the target set
defaults = {
    "num_generations": 8,
    "max_completion_length": 4,
    "temperature": 0.4,
    "learning_rate": 3e-3,
    "token_budget": 0,
    "train_batch_size": 32,
    "gradient_accumulation_steps": 1,
    "max_inflight_per_replica": 4,
    "queue_maxsize": 8,
    "weight_sync_steps": 1,
    "max_steps": 30,
    "save_steps": 1000,
}


def check_model(base_model: str) -> None:
    """Refuse a BASE_MODEL that `lorafleet make-tiny-model` did not build (the targets come from its weights)."""
    marker = Path(base_model) / MODEL_MARKER
    if not marker.exists():
        raise ConfigError(
            f"BASE_MODEL: TRAINER_TASK=tiny needs a model built by `lorafleet make-tiny-model DIR` ({marker} not found)"
        )
    try:
        json.loads(marker.read_text())
    except ValueError:
        raise ConfigError(
            f"BASE_MODEL: {marker} is corrupt; rebuild the model with `lorafleet make-tiny-model DIR`"
        ) from None


def build_task(tokenizer: Any, settings: TrainerSettings) -> dict[str, Any]:
    check_model(settings.base_model)
    targets = tiny_targets(settings.base_model, tokenizer)
    return {
        "train_dataset": tiny_dataset(targets, seed=settings.seed),
        "eval_dataset": tiny_dataset(targets, prompts=EVAL_PROMPTS, seed=settings.seed + 10_000),
        "reward_funcs": [target_token_reward],
    }
