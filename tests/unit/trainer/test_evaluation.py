"""Evaluation passes: greedy episodes through a completion server, scored with the task's rewards, logged with the
next training step."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from datasets import Dataset
from lorafleet.settings import load_settings
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_trainer.evaluation import EvalCallback, Evaluator, eval_callbacks
from lorafleet_trainer.recipes import load_tokenizer
from lorafleet_trainer.tasks.spec import Task, TaskSettings


class _Greedy(BaseHTTPRequestHandler):
    """Answers every completion with `reply` and records what was asked."""

    reply: ClassVar[list[int]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({**body, "authorization": self.headers.get("Authorization")})
        payload = json.dumps({"choices": [{"token_ids": type(self).reply}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")))


@pytest.fixture
def server():
    _Greedy.bodies.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Greedy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def says_yes(completions: list[Any], **_: Any) -> list[float]:
    return [float("yes" in completion[0]["content"]) for completion in completions]


def expected_word(completions: list[Any], word: list[str], **_: Any) -> list[float]:
    return [float(w in completion[0]["content"]) for completion, w in zip(completions, word, strict=True)]


def broken(**_: Any) -> list[float]:
    raise RuntimeError("no scorer")


def task_with(tokenizer: Any, rewards: list[Any], threshold: float) -> Task:
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(4)],
                              "word": ["yes", "yes", "no", "no"]})
    return Task(TaskSettings("t", "t.py", pass_threshold=threshold), train_dataset=rows, reward_funcs=rewards,
                eval_dataset=rows, tokenizer=tokenizer)


def test_an_eval_pass_scores_greedy_answers_of_the_published_version(tokenizer, server):
    import asyncio

    _Greedy.reply = tokenizer.encode("yes<|im_end|>", add_special_tokens=False)
    settings = load_settings(trainer_vllm_url=server + "/runs/a", max_completion_length=7)
    evaluator = Evaluator(task_with(tokenizer, [says_yes, expected_word, broken], 2.0), settings, "lfr_key")
    result = asyncio.run(evaluator.evaluate(step=10, model_version=3))
    assert (result.rows, result.passed, result.pass_at_1) == (4, 2, 0.5)  # says_yes + expected_word >= 2 on two
    assert result.by_function == {"says_yes": 1.0, "expected_word": 0.5, "broken": None}
    assert result.reward == 1.5 and result.failed_requests == 0
    logs = result.as_logs()
    assert logs["eval/rewards/says_yes"] == 1.0 and "eval/rewards/broken" not in logs
    # how often each function scored above 0 (a format reward's rate); a broken one scored no row
    assert (logs["eval/nonzero/says_yes"], logs["eval/nonzero/expected_word"], logs["eval/nonzero/broken"]) == (
        1.0, 0.5, 0.0)
    assert (logs["eval/step"], logs["eval/model_version"]) == (10.0, 3.0)
    assert {(b["model"], b["temperature"], b["max_tokens"], b["authorization"]) for b in _Greedy.bodies} == {
        ("trl-policy-v3", 0.0, 7, "Bearer lfr_key")}


def test_the_result_rides_on_the_next_logged_step(tokenizer, server):
    _Greedy.reply = tokenizer.encode("no<|im_end|>", add_special_tokens=False)
    settings = load_settings(trainer_vllm_url=server, eval_every_steps=5)
    written: list[tuple[int, dict[str, Any]]] = []
    (callback,) = eval_callbacks(task_with(tokenizer, [says_yes], 1.0), settings, "", main_rank=True,
                                 write=lambda step, values: written.append((step, values)))
    assert isinstance(callback, EvalCallback)
    callback.bind(SimpleNamespace(model_version=2))
    state = SimpleNamespace(global_step=3, is_world_process_zero=True)
    callback.on_step_end(None, state, None)  # neither step 1 nor a multiple of 5: nothing
    assert callback._running is None
    state.global_step = 5
    callback.on_step_end(None, state, None)
    callback._running.join(30)
    logs: dict[str, Any] = {"reward": 0.1}
    callback.on_log(None, state, None, logs=logs)
    assert logs["eval/pass_at_1"] == 0.0 and logs["eval/model_version"] == 2.0 and logs["reward"] == 0.1
    again: dict[str, Any] = {}
    callback.on_log(None, state, None, logs=again)
    assert again == {}  # logged once
    state.global_step = 10  # the last step: its pass ends after training, on a line of its own
    callback.on_step_end(None, state, None)
    callback.on_train_end(None, state, None)
    assert [(step, values["eval/step"]) for step, values in written] == [(10, 10.0)]


def test_no_eval_without_an_eval_set_a_period_or_off_the_main_rank(tokenizer):
    task = task_with(tokenizer, [says_yes], 1.0)
    assert eval_callbacks(task, load_settings(eval_every_steps=0), "", True, print) == []
    assert eval_callbacks(task, load_settings(), "", False, print) == []
    no_eval = Task(task.settings, task.train_dataset, task.reward_funcs, tokenizer=tokenizer)
    assert eval_callbacks(no_eval, load_settings(), "", True, print) == []
