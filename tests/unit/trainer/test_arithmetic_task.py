"""tasks/arithmetic.py: its rewards score what its docstring says, its held-out set is never trained on, and it passes
every check the trainer runs before it touches a fleet."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet.settings import load_settings
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_trainer.recipes import load_tokenizer
from lorafleet_trainer.tasks.checks import prepare_task
from lorafleet_trainer.tasks.loader import import_task

TASK = Path(__file__).resolve().parents[3] / "tasks" / "arithmetic.py"


@pytest.fixture(scope="module")
def arithmetic():
    return import_task(str(TASK))[0]


def said(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def total(arithmetic, text: str, answer: int) -> float:
    """The summed reward TRL gives one reply."""
    return sum(reward(said(text), answer=[answer])[0] for reward in arithmetic.reward_funcs)


def test_correct_reads_the_last_number_and_bare_number_wants_the_right_number_alone(arithmetic):
    replies = said("25", "12 + 13 = 25", "12 + 13 = 24", "The answer is 25 apples.", "", " -3\n", "24")
    answers = [25, 25, 25, 25, 25, -3, 25]
    assert arithmetic.correct(replies, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert arithmetic.bare_number(replies, answers) == [0.2, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0]


def test_a_row_passes_exactly_when_it_is_correct(arithmetic):
    """pass@1 is accuracy: a correct reply passes in any form, a bare wrong number does not."""
    for text, answer, passes in (("7", 7, True), ("3 + 4 = 7", 7, True), ("8", 7, False), ("3 + 4 = 8", 7, False)):
        assert (total(arithmetic, text, answer) >= arithmetic.pass_threshold) is passes, text


REPLY_TEXT = st.text(alphabet=st.sampled_from(list("0123456789 -+=.\nabc?")), max_size=24)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(answer=st.integers(min_value=-20, max_value=200), wrong=REPLY_TEXT, right=REPLY_TEXT, pad=st.booleans())
def test_no_wrong_reply_scores_above_a_right_one(arithmetic, answer, wrong, right, pad):
    """The shaping never beats the goal: whatever the form of either reply, a wrong answer scores below a right one
    (a right reply: any text that ends on the answer; a wrong one: any text whose last number is not it)."""
    right_text = f"{right} {answer}" + (" \n" if pad else "")
    if arithmetic.is_correct(wrong, answer):
        wrong = f"{wrong} {answer + 1}"
    assert arithmetic.is_correct(right_text, answer) and not arithmetic.is_correct(wrong, answer)
    assert total(arithmetic, wrong, answer) == 0.0 < arithmetic.CORRECT <= total(arithmetic, right_text, answer)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(answer=st.integers(min_value=-20, max_value=200), text=REPLY_TEXT)
def test_every_reply_passes_exactly_when_it_is_correct(arithmetic, answer, text):
    """Any reply, generated: the summed reward reaches the pass threshold if and only if the answer is right."""
    passes = total(arithmetic, text, answer) >= arithmetic.pass_threshold
    assert passes is arithmetic.is_correct(text, answer)


@pytest.mark.timeout(60)
def test_the_held_out_problems_are_never_trained_on(arithmetic):
    asked = {row["prompt"][1]["content"] for row in arithmetic.train_dataset}
    held_out = [row["prompt"][1]["content"] for row in arithmetic.eval_dataset]
    assert len(held_out) == arithmetic.EVAL_ROWS and not asked & set(held_out)
    assert {row["prompt"][0]["content"] for row in arithmetic.eval_dataset} == {arithmetic.SYSTEM}


@pytest.mark.timeout(300)
def test_the_task_passes_every_check(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny")  # the checks render prompts with a tokenizer; the tiny one is offline
    task, _ = prepare_task(load_settings(trainer_task=str(TASK), base_model=str(tiny)), load_tokenizer(str(tiny)))
    assert task.summary()["rewards"] == ["correct", "bare_number"]
    assert task.settings.defaults["base_model"] == "smollm2-135m" and task.settings.pass_threshold == 1.0
