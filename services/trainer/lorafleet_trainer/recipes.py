"""Recipes: what to train on, how to score it, and the defaults that make each one work.

- `math`: the published run, Qwen2.5-Math-1.5B on sail/Sanity-Test-R1D-1.5B (1,460 MATH problems),
  reward = last `\\boxed{}` vs the gold answer (normalised, math-verify fallback), 0 when truncated.
  With DATASET_PATH set it reads a local copy of the set instead of the Hub (offline boxes).
- `jsonl`: the same task on a local JSONL/Parquet file (DATASET_PATH) with problem/solution columns.
- `tiny`: the offline tiny model (`lorafleet make-tiny-model`) on a synthetic task whose reward a
  rank-1 adapter raises within minutes on 2 CPU cores (see `tiny_targets`).

A recipe's `defaults` apply only to settings nobody set (env, .env or flag).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.settings import ConfigError, Settings
from lorafleet.tiny import MODEL_MARKER, WORDS

from lorafleet_trainer.rewards import boxed_answer_reward, target_token_reward

MATH_DATASET = "sail/Sanity-Test-R1D-1.5B"
MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
PROBLEM_COLUMNS = ("problem", "question", "prompt")
SOLUTION_COLUMNS = ("solution", "answer", "gold")

TINY_ANCHOR = " cat"
TINY_TARGETS = 32
TINY_PROMPTS = 256


def _column(columns: Sequence[str], candidates: Sequence[str], what: str, source: str) -> str:
    for name in candidates:
        if name in columns:
            return name
    raise ConfigError(f"{source}: no {what} column (looked for {', '.join(candidates)}; found {', '.join(columns)})")


def to_prompt_rows(dataset: Any, source: str) -> Any:
    """Map problem/solution rows to TRL's shape: `prompt` = [system, user] messages, `solution` kept for the reward."""
    problem = _column(dataset.column_names, PROBLEM_COLUMNS, "problem", source)
    solution = _column(dataset.column_names, SOLUTION_COLUMNS, "solution", source)

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt": [
                {"role": "system", "content": MATH_SYSTEM_PROMPT},
                {"role": "user", "content": str(row[problem])},
            ],
            "solution": str(row[solution]),
        }

    return dataset.map(convert, remove_columns=dataset.column_names)


def load_local_dataset(path: str) -> Any:
    """A JSONL or Parquet file (or a directory of them) as a datasets.Dataset."""
    from datasets import load_dataset

    if not path:
        raise ConfigError("DATASET_PATH: required by TRAINER_RECIPE=jsonl (a .jsonl or .parquet file)")
    location = Path(path)
    if not location.exists():
        raise ConfigError(f"DATASET_PATH: {path} does not exist")
    files = sorted(location.glob("*.parquet")) + sorted(location.glob("*.jsonl")) if location.is_dir() else [location]
    if not files:
        raise ConfigError(f"DATASET_PATH: {path} holds no .jsonl or .parquet file")
    kind = "parquet" if files[0].suffix == ".parquet" else "json"
    return load_dataset(kind, data_files=[str(item) for item in files], split="train")


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, taught to parse replies when TRL does not recognise its chat template.

    TRL's rollout child parses every reply with `parse_response`, which needs a response template; TRL
    sets one only for templates it knows (not Qwen2.5-Math's, not the tiny model's). Both are ChatML,
    which TRL's Qwen template parses, so that one is used for any ChatML template.
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>" not in (tokenizer.chat_template or ""):
            raise ConfigError(
                f"BASE_MODEL: TRL cannot parse replies of {model}'s chat template (not one it knows, not ChatML)"
            ) from None
        tokenizer.response_template = qwen3_template
    return tokenizer


def tiny_targets(model_dir: str, tokenizer: Any, count: int = TINY_TARGETS) -> list[int]:
    """The tiny task's rewarded tokens: the `count` tokens whose embeddings point most along the anchor's.

    The tiny model's logits are nearly uniform and its final norm caps any logit near 2.5, so a
    random token set cannot be pushed far. Tokens clustered around one embedding direction can:
    one hidden-state direction (one rank) raises them all, from ~3% of generated tokens toward ~30%.
    """
    import torch
    from safetensors import safe_open

    anchor = tokenizer.encode(TINY_ANCHOR, add_special_tokens=False)
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
        embeddings = weights.get_tensor("model.embed_tokens.weight").float()
    scores = embeddings @ embeddings[anchor[0]]
    return sorted(int(index) for index in torch.topk(scores, count).indices)


def tiny_dataset(target_ids: list[int], prompts: int = TINY_PROMPTS, seed: int = 0) -> Any:
    """Seeded synthetic prompts from the tiny tokenizer's vocabulary, each row carrying the target set.

    Prompts are 60-100 words (~150-250 tokens): longer than one CPU KV block (128 tokens), so the
    rollouts of one prompt share a cacheable prompt-specific block and prefix routing has work to do.
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 100))) for _ in range(prompts)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": text}] for text in rows],
            "target_ids": [target_ids] * prompts,
        }
    )


@dataclass(frozen=True)
class Recipe:
    name: str
    defaults: dict[str, Any] = field(default_factory=dict)

    def check(self, settings: Settings) -> None:
        """Refuse settings the recipe cannot run with, naming the variable."""
        if self.name == "tiny":
            marker = Path(settings.base_model) / MODEL_MARKER
            if not marker.exists():
                raise ConfigError(
                    f"BASE_MODEL: TRAINER_RECIPE=tiny needs a model built by `lorafleet make-tiny-model DIR` "
                    f"({marker} not found)"
                )
            try:
                json.loads(marker.read_text())
            except ValueError:
                raise ConfigError(
                    f"BASE_MODEL: {marker} is corrupt; rebuild the model with `lorafleet make-tiny-model DIR`"
                ) from None

    def build(self, settings: Settings) -> tuple[Any, Any, list[Callable[..., list[float]]]]:
        """(tokenizer, train_dataset, reward_funcs) for this recipe."""
        tokenizer = load_tokenizer(settings.base_model)
        if self.name == "tiny":
            return tokenizer, tiny_dataset(tiny_targets(settings.base_model, tokenizer), seed=settings.seed), [
                target_token_reward
            ]
        if self.name == "jsonl" or settings.dataset_path:
            dataset = to_prompt_rows(load_local_dataset(settings.dataset_path), settings.dataset_path)
        else:
            from datasets import load_dataset

            dataset = to_prompt_rows(load_dataset(MATH_DATASET, split="train"), MATH_DATASET)
        reward = functools.partial(boxed_answer_reward, max_completion_length=settings.max_completion_length)
        return tokenizer, dataset, [reward]


RECIPES: dict[str, Recipe] = {
    "math": Recipe("math"),
    "jsonl": Recipe("jsonl"),
    # Small and fast on 2 CPU cores: 4 groups of 8 rollouts of 4 tokens per step (short completions keep
    # GRPO's per-completion credit close to per-token), a sync every step, a short queue so samples
    # stay fresh, a learning rate a rank-1 adapter moves visibly with.
    "tiny": Recipe(
        "tiny",
        defaults={
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
        },
    ),
}
