"""Datasets become TRL prompt rows; tokenizers get a response template; the built-in tasks are well-formed."""

from __future__ import annotations

import json

import pytest
from lorafleet.settings import ConfigError, load_settings
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_trainer.recipes import (
    MATH_SYSTEM_PROMPT,
    load_local_dataset,
    load_tokenizer,
    tiny_targets,
    to_prompt_rows,
)
from lorafleet_trainer.tasks.checks import prepare_task
from trl.chat_template_utils import parse_response

ROWS = [
    {"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$", "level": "Level 1"},
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "\\boxed{\\frac{1}{2}}", "level": "Level 2"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _write(path, rows):
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("name", ["math.jsonl", "math.parquet"])
def test_local_dataset_becomes_system_user_prompts_with_solution(tmp_path, name):
    dataset = to_prompt_rows(load_local_dataset(str(_write(tmp_path / name, ROWS))), name)
    assert sorted(dataset.column_names) == ["prompt", "solution"]  # extra columns are not passed to the reward
    assert dataset[0]["prompt"] == [
        {"role": "system", "content": MATH_SYSTEM_PROMPT},
        {"role": "user", "content": "What is $1+1$?"},
    ]
    assert dataset[1]["solution"] == "\\boxed{\\frac{1}{2}}"


def test_question_answer_columns_are_accepted(tmp_path):
    rows = [{"question": "2+2?", "answer": "4"}]
    dataset = to_prompt_rows(load_local_dataset(str(_write(tmp_path / "qa.jsonl", rows))), "qa.jsonl")
    assert dataset[0]["solution"] == "4" and dataset[0]["prompt"][1]["content"] == "2+2?"


def test_missing_solution_column_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"problem": "x", "hint": "y"}])
    expected = r"no solution column \(looked for solution, answer, gold; found problem, hint"
    with pytest.raises(ConfigError, match=expected):
        to_prompt_rows(load_local_dataset(str(path)), str(path))


@pytest.mark.parametrize(
    ("path", "message"), [("", "required by TRAINER_TASK=jsonl"), ("/nope.jsonl", "does not exist")]
)
def test_dataset_path_errors_name_the_variable(path, message):
    with pytest.raises(ConfigError, match=f"DATASET_PATH: .*{message}"):
        load_local_dataset(path)


@pytest.mark.parametrize("task", ["jsonl", "math"])  # math reads a local copy of the set when DATASET_PATH is set
def test_task_builds_prompts_and_a_picklable_reward_from_a_local_file(tmp_path, tiny, task):
    path = _write(tmp_path / "d.parquet", ROWS)
    settings = load_settings(base_model=str(tiny), dataset_path=str(path), max_completion_length=64,
                             trainer_task=task)
    built, tokenizer = prepare_task(settings)  # the checks pass: the reward runs on dummy completions
    (reward,) = built.reward_funcs
    assert len(built.train_dataset) == 2 and built.eval_dataset is None  # too small a file to hold problems out
    assert reward.keywords == {"max_completion_length": 64}
    assert tokenizer.response_template is not None


def test_math_holds_out_the_same_eval_problems_on_every_run(tmp_path, tiny):
    rows = [{"problem": f"What is {n} + 1?", "solution": f"\\boxed{{{n + 1}}}"} for n in range(300)]
    path = _write(tmp_path / "d.jsonl", rows)
    settings = load_settings(base_model=str(tiny), dataset_path=str(path), trainer_task="math")
    first, _ = prepare_task(settings)
    again, _ = prepare_task(settings)
    assert (len(first.train_dataset), len(first.eval_dataset)) == (236, 64)
    assert first.eval_dataset["solution"] == again.eval_dataset["solution"]
    assert not set(first.eval_dataset["solution"]) & set(first.train_dataset["solution"])


def test_chatml_template_trl_does_not_know_gets_a_response_template(tiny):
    tokenizer = load_tokenizer(str(tiny))
    ids = tokenizer.encode("hello there<|im_end|>", add_special_tokens=False)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=False)
    assert parse_response(tokenizer, ids, prefix=prompt)["content"] == "hello there"


def test_tiny_task_targets_cluster_around_the_anchor_and_ride_in_every_row(tiny):
    settings = load_settings(base_model=str(tiny), trainer_task="tiny")
    task, tokenizer = prepare_task(settings)
    dataset, (reward,) = task.train_dataset, task.reward_funcs
    targets = tiny_targets(str(tiny), tokenizer)
    assert len(set(targets)) == 32 and all(0 <= t < len(tokenizer) for t in targets)
    anchor = tokenizer.encode(" cat", add_special_tokens=False)[0]
    assert anchor in targets
    assert len(dataset) == 256 and all(row["target_ids"] == targets for row in dataset.select(range(5)))
    assert dataset[0]["prompt"][0]["role"] == "user"
    assert reward.__name__ == "target_token_reward"
