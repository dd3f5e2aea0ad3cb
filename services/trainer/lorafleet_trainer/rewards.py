"""Reward functions. Module-level on purpose: TRL pickles them into its spawned rollout child.

TRL calls `reward(completions=..., prompts=..., completion_ids=..., **dataset_columns)` once per
group; `completions[i]` is a list of message dicts, `completion_ids[i]` every generated token id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
# Units and decorations that do not change the answer (after the reference recipe's normalisation).
_UNITS = re.compile(
    r"(?<=[\d\s}])\s*(?:units?|degrees?|cm|centimeters?|meters?|m|km|inches|inch|feet|ft|hours?|minutes?|seconds?|"
    r"dollars?|cents?|square\s+units?|sq\s+units?)\s*$"
)
_STRIP = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "^\\circ", "^{\\circ}", "\\%", "%", "\\displaystyle",
)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is none."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for index in range(start, len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:index]
        # unbalanced (truncated inside the box): try the previous box
    return None


def normalize_answer(answer: str) -> str:
    """Canonical string form of a final answer: `\\dfrac` = `\\frac`, no units, spaces, `$` or `\\left`."""
    text = answer.strip()
    for _ in range(3):  # nested \text{...}
        text = _TEXT_WRAPPER.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _STRIP:
        text = text.replace(token, "")
    text = _UNITS.sub("", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)  # \frac12 -> \frac{1}{2}
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):  # 1,000 -> 1000
        text = text.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d*?0+", text):  # 2.50 -> 2.5, 3.0 -> 3
        text = text.rstrip("0").rstrip(".")
    return text


def _math_verify_equal(gold: str, predicted: str) -> bool:
    """math-verify's symbolic comparison of two answers (both given as LaTeX inside `$...$`)."""
    from math_verify import parse, verify

    try:
        gold_parsed = parse(f"${gold}$")
        predicted_parsed = parse(f"${predicted}$")
        return bool(gold_parsed and predicted_parsed and verify(gold_parsed, predicted_parsed))
    except Exception:  # math-verify raises on LaTeX it cannot read: that answer is simply not verified
        return False


def gold_answer(solution: str) -> str:
    """The reference answer: the last box of a worked solution, else the solution string itself."""
    boxed = last_boxed(solution)
    return boxed if boxed is not None else solution


def score_boxed_answer(completion: str, solution: str, *, truncated: bool = False) -> float:
    """1.0 when the completion's last boxed answer equals the gold answer, else 0.0; 0.0 when truncated."""
    if truncated:
        return 0.0
    predicted = last_boxed(completion)
    if predicted is None:
        return 0.0
    gold = gold_answer(solution)
    if normalize_answer(predicted) == normalize_answer(gold):
        return 1.0
    return 1.0 if _math_verify_equal(gold, predicted) else 0.0


def completion_text(completion: Any) -> str:
    """The text of one completion: TRL passes a list of message dicts, plain strings are accepted too."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def boxed_answer_reward(
    completions: Sequence[Any],
    solution: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    max_completion_length: int,
    **_: Any,
) -> list[float]:
    """The published MATH reward: last `\\boxed{}` vs the gold answer, 0 when the completion hit the length cap.

    Bind `max_completion_length` with functools.partial (picklable) to the trainer's value.
    """
    return [
        score_boxed_answer(completion_text(text), gold, truncated=len(ids) >= max_completion_length)
        for text, gold, ids in zip(completions, solution, completion_ids, strict=True)
    ]


def target_token_reward(
    completion_ids: Sequence[Sequence[int]], target_ids: Sequence[Sequence[int]], **_: Any
) -> list[float]:
    """Fraction of generated tokens that belong to the row's target token set (the tiny recipe's task).

    Every token is rewarded or not on its own, so GRPO gets a dense, per-token signal that a
    rank-1 adapter can follow within a few CPU minutes.
    """
    rewards = []
    for ids, targets in zip(completion_ids, target_ids, strict=True):
        wanted = set(targets)
        rewards.append(sum(token in wanted for token in ids) / len(ids) if ids else 0.0)
    return rewards
