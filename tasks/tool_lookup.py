"""`tool_lookup`: multi-turn tool use, small enough to train on 2 CPU cores (tiny model, rank-1 LoRA, 60 steps).

The game: each prompt asks the colour of one of four animals, and only the `lookup` tool knows the colours. An
episode is won when the model looks the asked animal up (TRL runs the call and hands the colour back as a tool
message); looking up another animal is half a win; calling nothing is none. So `tools/call_frequency` and the reward
rise together when the policy learns to call.

On the tiny model (`lorafleet make-tiny-model DIR`) every call is one token (`lorafleet.tiny_vocabulary.TOOL_CALLS`,
one per animal), emitted at ~6% after the tools block, and one LoRA rank raises all four. A rank-1 adapter cannot tell
the prompts apart (the tiny model's last hidden state barely depends on them), so it learns to call, not whom to call:
in an offline GRPO replay of these defaults (30 steps of 4 groups of 8) calls went from ~6% of episodes to ~65% and
the mean reward from ~0.04 to ~0.4 (0.65 x (1/4 x 1.0 + 3/4 x 0.5)), most of it within 10 steps.

Why MAX_COMPLETION_LENGTH 1: TRL re-renders the conversation after every turn and trains only tokens that survive
re-rendering. Its Qwen response parser moves any text generated next to a call into `content`, which the template
(like Qwen2.5's) renders before the call, with whitespace stripped; the turn then re-tokenizes differently from what
was sampled, TRL's reconciler keeps it as context, and the call token gets no gradient. A one-token turn is the call
and nothing else. On a real model (one that writes calls as text), raise MAX_COMPLETION_LENGTH.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet.settings import ConfigError
from lorafleet.tiny_vocabulary import MODEL_MARKER, TOOL_CALLS, TOOL_KEYS, TOOL_NAME
from lorafleet_trainer.tasks.builtin.tiny import defaults as TINY_DEFAULTS

COLOURS = {"fox": "red", "owl": "white", "bee": "gold", "cow": "black"}
QUESTIONS = ("what colour is the {} ?", "the {} is what colour ?", "colour of the {} ?", "is the {} red or blue ?")
TRAIN_PROMPTS = 256
EVAL_PROMPTS = 16
WIN, OTHER_ANIMAL = 1.0, 0.5

pass_threshold = WIN  # an eval episode passes when it looked up the animal it was asked about
# The tiny task's defaults, but one token per turn (see the module docstring) and 60 steps (the demo's length).
defaults = {**TINY_DEFAULTS, "max_completion_length": 1, "max_steps": 60}
# One tool round: call, read the colour, answer. A second call in the answer turn is not run (TRL counts it in
# tools/loop_exhausted_frac).
trl_args = {"max_tool_calling_iterations": 1}


def lookup(key: str) -> str:
    """The colour of an animal.

    Args:
        key: The animal.
    """
    return COLOURS.get(str(key).strip().lower(), "unknown")


_CALL = re.compile(r'<tool_call>\s*\{"name":\s*"' + TOOL_NAME + r'",\s*"arguments":\s*\{"key":\s*"([^"]*)"\}\}')


def _colours_seen(completion: Any) -> list[str]:
    """What the episode's lookups answered: the tool messages TRL appended (a plain-text completion: its calls)."""
    if isinstance(completion, str):
        return [lookup(key) for key in _CALL.findall(completion)]
    return [
        str(message.get("content", "")).strip()
        for message in completion or []
        if isinstance(message, Mapping) and message.get("role") == "tool" and message.get("name") == TOOL_NAME
    ]


def lookup_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """WIN when a lookup brought back the asked animal's colour, OTHER_ANIMAL for any other lookup, else 0."""
    scores = []
    for completion, colour in zip(completions, answer, strict=True):
        seen = _colours_seen(completion)
        scores.append(WIN if colour in seen else OTHER_ANIMAL if any(c in COLOURS.values() for c in seen) else 0.0)
    return scores


def lookup_dataset(prompts: int, seed: int) -> Any:
    """Seeded questions, one animal each; `key` and `answer` ride along for the reward."""
    from datasets import Dataset

    rng = random.Random(seed)
    keys = [rng.choice(TOOL_KEYS) for _ in range(prompts)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": rng.choice(QUESTIONS).format(key)}] for key in keys],
            "key": keys,
            "answer": [COLOURS[key] for key in keys],
        }
    )


def _check_tiny_model(tokenizer: Any, settings: Any) -> None:
    """A tiny model built before the call tokens existed cannot emit a call: say so instead of training nothing."""
    if (Path(settings.base_model) / MODEL_MARKER).exists() and not all(
        call in tokenizer.get_vocab() for call in TOOL_CALLS
    ):
        raise ConfigError(
            f"BASE_MODEL: {settings.base_model} is a tiny model without tool-call tokens; rebuild it with "
            "`lorafleet make-tiny-model DIR`"
        )


def build_task(tokenizer: Any, settings: Any) -> dict[str, Any]:
    _check_tiny_model(tokenizer, settings)
    return {
        "train_dataset": lookup_dataset(TRAIN_PROMPTS, settings.seed),
        "eval_dataset": lookup_dataset(EVAL_PROMPTS, settings.seed + 10_000),
        "reward_funcs": [lookup_reward],
        "tools": [lookup],
    }
