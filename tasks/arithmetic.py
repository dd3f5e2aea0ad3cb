"""`arithmetic`: a real model (SmolLM2-135M-Instruct, `BASE_MODEL=smollm2-135m`) learns to add, on 2 CPU cores.

    make demo TASK=tasks/arithmetic.py       # the task picks its model: smollm2-135m, converted on first use
    lorafleet doctor --task tasks/arithmetic.py

Each prompt asks "What is a + b?"; the model answers in a few tokens. Untrained, it gets a minority of them right
(greedy) and writes the sum inside a sentence or an equation ("12 + 13 = 25") far more often than as the bare number
the system prompt asks for, so both rewards start low with room to rise, and GRPO groups sampled at temperature 1
disagree (reward variance to learn from). Harder rows (two-digit sums, then a + b - c) sit in the same stream, so
learning does not stop where small sums saturate. What one run reached: docs/benchmarks/real-model.md.

Two rewards, summed by TRL and logged apart (`rewards/correct`, `rewards/bare_number` in metrics.jsonl): `correct`
(1.0 when the last number of the reply is the answer) and `bare_number` (0.2 when the reply is the answer as a
number and nothing else). The format credit is paid only on a correct answer, and is small, on purpose: shaping must
never beat the goal. An earlier version paid 0.5 for any bare number, right or wrong; in one of two runs the policy
learned to drop its `a + b =` scratch work (which it computes in) for bare guesses, and held-out accuracy fell back
while the summed reward kept rising. Gated, a wrong reply scores 0 whatever its form, so no completion earns more by
being wrong in the right format than by being right; small, a policy that trades accuracy for the format gains only
if it keeps more than 1/1.2 (83%) of its accuracy. A row passes evaluation when its sum reaches 1.0, exactly when it
is correct: pass@1 is accuracy, and the evaluator's `eval/nonzero/bare_number` is the share answered right and bare.

The 64 held-out problems are drawn first from their own seed, and no training row asks one of them.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

SYSTEM = "You are a calculator. Reply with the answer as a bare number, nothing else."
EVAL_ROWS = 64
TRAIN_ROWS = 2048
CORRECT, FORMAT = 1.0, 0.2  # format credit: small, and only on a correct answer (see above)
# (share of rows, the problem kind): mostly what the model half knows, some of what it rarely gets.
LEVELS = ((0.6, "small"), (0.25, "two_digit"), (0.15, "three_terms"))
NUMBER = re.compile(r"-?\d+")
BARE = re.compile(r"\s*-?\d+\.?\s*")

pass_threshold = CORRECT
# For 2 CPU cores (docs/benchmarks/real-model.md): a rank-8 adapter, groups of 8, short replies, and a wall-clock
# budget rather than a step count: `make demo TASK=tasks/arithmetic.py` trains for RUN_MAX_WALL_S (15 min) at most.
# 15 rather than 17 minutes: both earlier runs had gained over 20 points of held-out pass@1 by their fifth step.
defaults = {"base_model": "smollm2-135m", "lora_rank": 8, "lora_alpha": 16, "learning_rate": 5e-4,
            "num_generations": 8, "max_completion_length": 12, "temperature": 1.0, "token_budget": 0,
            "train_batch_size": 32, "gradient_accumulation_steps": 1, "max_inflight_per_replica": 8,
            "queue_maxsize": 16, "weight_sync_steps": 1, "max_steps": 200, "run_max_wall_s": 900,
            "max_model_len": 512}


def problem(rng: random.Random, kind: str) -> tuple[str, int]:
    """One question of `kind` and its answer."""
    if kind == "small":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"What is {a} + {b}?", a + b
    if kind == "two_digit":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} + {b}?", a + b
    a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 20)
    return f"What is {a} + {b} - {c}?", a + b - c


def rows(rng: random.Random, count: int, exclude: set[str]) -> list[dict]:
    """`count` rows of the LEVELS mix whose questions are not in `exclude`."""
    kinds = [kind for share, kind in LEVELS for _ in range(round(share * 100))]
    out: list[dict] = []
    while len(out) < count:
        question, answer = problem(rng, rng.choice(kinds))
        if question not in exclude:
            out.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                        "answer": answer})
    return out


def reply(completion: list[dict]) -> str:
    """The assistant's text of one rollout (TRL passes its messages)."""
    return str(completion[0].get("content") or "") if completion else ""


def is_correct(text: str, wanted: int) -> bool:
    """Whether the last number of `text` is `wanted` (the model may show its work before it)."""
    numbers = NUMBER.findall(text)
    return bool(numbers) and int(numbers[-1]) == wanted


def correct(completions, answer, **kwargs):
    """1.0 when the last number in the reply is the answer (`answer` is a dataset column)."""
    return [CORRECT if is_correct(reply(completion), wanted) else 0.0
            for completion, wanted in zip(completions, answer, strict=True)]


def bare_number(completions, answer, **kwargs):
    """0.2 when the reply is the right answer as a bare number, as the system prompt asks; nothing for a wrong one."""
    return [FORMAT if BARE.fullmatch(text := reply(completion)) and is_correct(text, wanted) else 0.0
            for completion, wanted in zip(completions, answer, strict=True)]


held_out = rows(random.Random(1), EVAL_ROWS, exclude=set())
eval_dataset = Dataset.from_list(held_out)
train_dataset = Dataset.from_list(rows(random.Random(0), TRAIN_ROWS,
                                       exclude={row["prompt"][1]["content"] for row in held_out}))
reward_funcs = [correct, bare_number]
