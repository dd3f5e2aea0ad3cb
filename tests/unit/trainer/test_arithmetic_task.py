"""tasks/arithmetic.py: its rewards score what its docstring says, its held-out set is never trained on, and it passes
every check the trainer runs before it touches a fleet."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_correct_reads_the_last_number_and_bare_number_wants_nothing_else(arithmetic):
    replies = said("25", "12 + 13 = 25", "12 + 13 = 24", "The answer is 25 apples.", "", " -3\n")
    assert arithmetic.correct(replies, [25, 25, 25, 25, 25, -3]) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert arithmetic.bare_number(replies) == [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]


def test_a_row_passes_exactly_when_it_is_correct(arithmetic):
    """pass@1 is accuracy: a correct reply passes in any form, a bare wrong number does not."""
    threshold = arithmetic.pass_threshold
    for text, answer, passes in (("7", 7, True), ("3 + 4 = 7", 7, True), ("8", 7, False), ("3 + 4 = 8", 7, False)):
        total = arithmetic.correct(said(text), [answer])[0] + arithmetic.bare_number(said(text))[0]
        assert (total >= threshold) is passes, text


def test_the_held_out_problems_are_never_trained_on(arithmetic):
    asked = {row["prompt"][1]["content"] for row in arithmetic.train_dataset}
    held_out = [row["prompt"][1]["content"] for row in arithmetic.eval_dataset]
    assert len(held_out) == arithmetic.EVAL_ROWS and not asked & set(held_out)
    assert {row["prompt"][0]["content"] for row in arithmetic.eval_dataset} == {arithmetic.SYSTEM}


def test_the_task_passes_every_check(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny")  # the checks render prompts with a tokenizer; the tiny one is offline
    task, _ = prepare_task(load_settings(trainer_task=str(TASK), base_model=str(tiny)), load_tokenizer(str(tiny)))
    assert task.summary()["rewards"] == ["correct", "bare_number"]
    assert task.settings.defaults["base_model"] == "smollm2-135m" and task.settings.pass_threshold == 1.0
