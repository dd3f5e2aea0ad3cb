"""The boxed-answer reward on real MATH-style cases, and the tiny task's token reward."""

from __future__ import annotations

import functools
import pickle

import pytest
from lorafleet_trainer.rewards import (
    boxed_answer_reward,
    last_boxed,
    normalize_answer,
    score_boxed_answer,
    target_token_reward,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("first \\boxed{1}, then corrected: \\boxed{2}", "2"),  # several boxes: the last
        ("\\boxed {x^{2}+1}", "x^{2}+1"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and then \\boxed{\\frac{1}{2", "3"),  # the last box was cut off: the previous one counts
        ("no box here, answer 5", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("completion", "solution", "reward"),
    [
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),  # \dfrac vs \frac
        ("\\boxed{\\frac12}", "The answer is $\\boxed{\\tfrac{1}{2}}$.", 1.0),  # gold from a worked solution
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # math-verify fallback
        ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{\\{a, b\\}}", "\\{a,b\\}", 1.0),
        ("\\boxed{2} then \\boxed{3}", "3", 1.0),  # the last box is the answer
        ("\\boxed{3} then \\boxed{2}", "3", 0.0),
        ("\\boxed{4}", "3", 0.0),
        ("the answer is 3", "3", 0.0),  # no box
        ("\\boxed{x+m}", "x", 0.0),  # a trailing letter is not a unit
    ],
)
def test_score_boxed_answer(completion, solution, reward):
    assert score_boxed_answer(completion, solution) == reward


def test_truncated_completion_scores_zero_even_when_right():
    assert score_boxed_answer("\\boxed{3}", "3", truncated=True) == 0.0


@pytest.mark.parametrize(("raw", "normal"), [(" \\dfrac{3}{4} ", "\\frac{3}{4}"), ("2.50", "2.5"), ("3.0", "3")])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_boxed_answer_reward_on_trl_shaped_input_zeroes_length_capped_completions():
    reward = functools.partial(boxed_answer_reward, max_completion_length=4)
    completions = [
        [{"role": "assistant", "content": "\\boxed{7}"}],
        [{"role": "assistant", "content": "\\boxed{7}"}],  # same text, but it hit the 4-token cap
        [{"role": "assistant", "content": "\\boxed{8}"}],
    ]
    rewards = reward(
        completions=completions, prompts=[[]] * 3, completion_ids=[[1, 2], [1, 2, 3, 4], [5]], solution=["7"] * 3
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert pickle.loads(pickle.dumps(reward)).func is boxed_answer_reward  # TRL ships it to a spawned child


def test_target_token_reward_is_the_fraction_of_target_tokens():
    rewards = target_token_reward(
        completions=[[]] * 3, completion_ids=[[1, 2, 3, 4], [9, 9], []], target_ids=[[2, 4, 9]] * 3
    )
    assert rewards == [0.5, 1.0, 0.0]
