"""The data and the tokenizer the built-in tasks (tasks/builtin) are made of: MATH rows, local files, the tiny task.

`load_tokenizer` serves every task: it teaches TRL to parse replies of ChatML templates it does not know.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorafleet.settings import ConfigError
from lorafleet.tiny_vocabulary import WORDS

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
        raise ConfigError("DATASET_PATH: required by TRAINER_TASK=jsonl (a .jsonl or .parquet file)")
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
