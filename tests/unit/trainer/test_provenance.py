"""Per-rollout provenance (issue 54, part 1): the proxy's headers reach the trainer through TRL's own rollout loop.

TRL's loop runs for real (in a thread, as test_task_guards does) against a scripted completions server that answers
as the proxy does, with provenance headers naming a different replica on every request.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import queue
import threading
from collections import deque
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import ConfigError, load_settings
from lorafleet.vllm_api import (
    PROXY_ADAPTER_HEADER,
    PROXY_ATTESTED_AGE_HEADER,
    PROXY_ATTESTED_HEADER,
    PROXY_FINGERPRINT_HEADER,
    PROXY_UPSTREAM_HEADER,
)
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.stub_http import JsonStub
from lorafleet_trainer.provenance import (
    ROLLOUTS_FILE,
    Answer,
    RolloutRecord,
    answer_from,
    logprob_key,
    record_rollouts,
)
from multidict import CIMultiDict

CALL = '<tool_call>\n{"name": "echo", "arguments": {"key": "red"}}\n</tool_call><|im_end|>'


class _Proxy(JsonStub):
    """Answers every completion as the proxy would, each from a replica of its own: replica-<n>."""

    reply_ids: ClassVar[list[int]] = []
    sent: ClassVar[list[Answer]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = self.json_body()
        ids = type(self).reply_ids
        with self.lock:
            answer = Answer(f"http://replica-{len(self.sent)}:8000", body["model"], f"sha256:{len(self.sent)}",
                            len(ids))
            self.sent.append(answer)
        self.answer({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]},
                    {PROXY_UPSTREAM_HEADER: answer.replica,
                     PROXY_ADAPTER_HEADER.lower(): answer.adapter,  # headers are case-insensitive
                     PROXY_FINGERPRINT_HEADER: answer.fingerprint})


def echo(key: str) -> str:
    """Echo a key.

    Args:
        key: what to echo
    """
    return key


def _one_reward(completions: list[Any], **_: Any) -> list[float]:
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from lorafleet_trainer.recipes import load_tokenizer

    return load_tokenizer(str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")))


def _samples(tokenizer: Any, text: str, *, tools: bool, count: int) -> list[Any]:
    """`count` samples from TRL's loop, wired as the trainer wires it, against a _Proxy server."""
    from accelerate.state import PartialState
    from lorafleet_trainer.fleet_rollouts import FleetRolloutLoop, wire_rollouts
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    PartialState()  # as TRL's child does: its logger needs it
    _Proxy.reply_ids = tokenizer.encode(text, add_special_tokens=False)
    _Proxy.sent = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    worker = AsyncRolloutWorker(
        model_name="tiny", dataset=[{"prompt": [{"role": "user", "content": "2+2?"}]}], reward_funcs=[_one_reward],
        tools=[echo] if tools else None, processing_class=tokenizer,
        eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
        vllm_server_url=f"http://127.0.0.1:{server.server_port}", max_inflight_tasks=2, num_generations=2,
        request_timeout=5, max_tool_calling_iterations=1, lora_name="trl-policy",
    )  # fmt: skip
    wire_rollouts(SimpleNamespace(rollout_worker=worker, accelerator=SimpleNamespace(is_main_process=True)), "",
                  load_settings())
    ctx = multiprocessing.get_context("spawn")
    buffer = ctx.Queue()  # pickles every sample, as the child's buffer does
    loop = FleetRolloutLoop(**worker._loop_kwargs, rollout_buffer=buffer, model_version_value=ctx.Value("i", 1),
                            heartbeat_value=ctx.Value("d", 0.0), failed_event=threading.Event(),
                            exception_info_queue=queue.Queue(), metrics_queue=queue.Queue())
    child = threading.Thread(target=loop.run, daemon=True)
    child.start()
    try:
        return [buffer.get(timeout=30) for _ in range(count)]
    finally:
        loop._loop.call_soon_threadsafe(loop._stop_event.set)
        child.join(timeout=30)
        server.shutdown()


def test_every_sample_carries_the_replica_adapter_and_fingerprint_that_answered_it(tokenizer):
    from lorafleet_trainer.fleet_rollouts import ProvenancedSample

    got = _samples(tokenizer, "four<|im_end|>", tools=False, count=4)
    assert all(isinstance(sample, ProvenancedSample) for sample in got)
    assert all(len(sample.answers) == 1 for sample in got)
    answers = [sample.answers[0] for sample in got]
    assert len(set(answers)) == 4 and set(answers) <= set(_Proxy.sent)  # each its own answer, none mixed up
    assert all(answer.adapter == "trl-policy-v1" and answer.tokens == len(_Proxy.reply_ids) for answer in answers)
    assert all(int(sample.completion_mask.sum()) == answers[0].tokens for sample in got)


def test_a_multi_turn_rollout_names_who_answered_each_turn_in_order(tokenizer):
    got = _samples(tokenizer, CALL, tools=True, count=2)  # a tool call, then (one iteration allowed) the last turn
    sent = {answer: index for index, answer in enumerate(_Proxy.sent)}
    for sample in got:
        assert len(sample.answers) == 2, sample.answers
        first, second = (sent[answer] for answer in sample.answers)  # both sent, the first turn's first
        assert first < second


@given(replica=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
       tokens=st.lists(st.integers(0, 50), max_size=8), upper=st.booleans())
def test_answer_from_reads_headers_in_any_case_and_names_nothing_without_a_proxy(
    replica: str, tokens: list[int], upper: bool
) -> None:
    name = PROXY_UPSTREAM_HEADER.upper() if upper else PROXY_UPSTREAM_HEADER.lower()
    answer = answer_from(CIMultiDict({name: replica}), {"choices": [{"token_ids": tokens}]})
    assert answer == Answer(replica, "", "", len(tokens))
    assert answer_from(CIMultiDict(), {}) == Answer("", "", "", 0)


@given(digest=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=72),
       age=st.one_of(st.floats(0, 1e6).map(lambda v: f"{v:.1f}"), st.sampled_from(["", "soon", "1e3x"])))
def test_answer_from_keeps_the_attested_digest_and_its_age(digest: str, age: str) -> None:
    answer = answer_from(CIMultiDict({PROXY_ATTESTED_HEADER: digest, PROXY_ATTESTED_AGE_HEADER: age}), {})
    assert answer.attested == digest
    try:
        expected: float | None = float(age)
    except ValueError:
        expected = None
    assert answer.attested_age_s == expected
    assert answer_from(CIMultiDict(), {}).attested_age_s is None


class _ListQueue:
    """A picklable stand-in for TRL's multiprocessing queue."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def get(self, timeout: float | None = None) -> Any:
        return self.items.pop(0)

    def qsize(self) -> int:
        return len(self.items)


def _sample(group: int, answers: tuple[Answer, ...]) -> Any:
    from lorafleet_trainer.fleet_rollouts import ProvenancedSample

    return ProvenancedSample(prompt=[], completion=[], input_ids=np.arange(6),
                             completion_mask=np.array([0, 0, 1, 1, 1, 0]), old_log_probs=np.zeros(6, np.float32),
                             advantage=0.5, model_version=3, group_id=group, metrics={}, answers=answers)


def test_the_trainer_records_each_sample_it_reads_also_from_a_packing_process(tmp_path: Path) -> None:
    """The record travels whole to TRAINER_FAST_STEP's packing process (resume.py's reader sends its inner queue)."""
    from lorafleet_trainer.resume import _ObservedQueue

    answer = Answer("http://r1:8000", "trl-policy-v3", "sha256:ab", 3)
    samples = _ListQueue([_sample(7, (answer,)), _sample(8, ())])
    trainer = SimpleNamespace(rollout_worker=object(), rollout_queue=samples)
    record_rollouts(trainer, tmp_path)
    observed = _ObservedQueue(trainer.rollout_queue, lambda: 3, 4, deque())
    assert observed.get().group_id == 7
    elsewhere = pickle.loads(pickle.dumps(observed))  # what a spawned packing process gets
    assert isinstance(elsewhere, RolloutRecord) and elsewhere.qsize() == 1
    assert elsewhere.get().group_id == 8
    lines = [json.loads(line) for line in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()]
    assert {line.pop("key") for line in lines} == {logprob_key(np.zeros(3, np.float32))}  # its trained logprobs
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"group": 7, "version": 3, "tokens": 3, "answers": [{"replica": "http://r1:8000", "adapter": "trl-policy-v3",
                                                             "fingerprint": "sha256:ab", "tokens": 3,
                                                             "attested": "", "attested_age_s": None}]},
        {"group": 8, "version": 3, "tokens": 3, "answers": []},
    ]


def test_a_trl_whose_samples_cannot_carry_provenance_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet_trainer import fleet_rollouts

    monkeypatch.setattr(fleet_rollouts, "_uses", lambda function, text: "for seq in sequences" not in text)
    with pytest.raises(ConfigError, match="lacks _score_group building one RolloutSample per training row"):
        fleet_rollouts.check_rollout_hooks()
