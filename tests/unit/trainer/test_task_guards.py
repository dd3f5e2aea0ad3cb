"""A task's code that raises, hangs or answers garbage never stops the rollouts: unit by unit, then in TRL's loop."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import load_settings
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.stub_http import JsonStub
from lorafleet_trainer.episodes import Episode
from lorafleet_trainer.tasks.guards import (
    MAX_HUNG_CALLS,
    FaultLog,
    TaskTimeout,
    call_with_timeout,
    clean_scores,
    guard_environment,
    guard_reward,
    guard_tool,
    hung_calls,
)

N = 3
KWARGS = {"completions": [[{"content": "x"}]] * N, "completion_ids": [[1]] * N}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def counted(faults: FaultLog) -> dict[str, float]:
    counters: dict[str, float] = {}
    faults.drain(counters)
    return counters


def raises(**_: Any) -> list[float]:
    raise KeyError("solution")


def hangs(**_: Any) -> list[float]:
    time.sleep(30)
    return [1.0] * N


async def hangs_async(**_: Any) -> list[float]:
    await asyncio.sleep(30)
    return [1.0] * N


@pytest.mark.parametrize(("func", "kind"), [(raises, "error"), (hangs, "timeout"), (hangs_async, "timeout")])
def test_a_reward_that_raises_or_hangs_scores_its_group_none_and_is_counted(func, kind):
    faults = FaultLog()
    started = time.monotonic()
    assert run(guard_reward(func, "mine", 0.3, faults)(**KWARGS)) == [None] * N
    assert time.monotonic() - started < 5
    assert counted(faults) == {f"task/mine/{kind}_total": 1}


@pytest.mark.parametrize(("answer", "scores", "garbage"), [
    ([1, 0.5, True], [1.0, 0.5, 1.0], False),
    ([None, 1.0, 0.0], [None, 1.0, 0.0], False),
    ([float("nan"), 1.0, float("inf")], [None, 1.0, None], True),
    ([1.0], [None] * N, True),
    ("good", [None] * N, True),
    ([1.0, "x", 0.0], [1.0, None, 0.0], True),
])
def test_a_reward_answer_trl_cannot_use_becomes_none(answer, scores, garbage):
    faults = FaultLog()

    async def answers(**_: Any) -> Any:
        return answer

    assert run(guard_reward(answers, "mine", 5, faults)(**KWARGS)) == scores
    assert counted(faults) == ({"task/mine/garbage_total": 1} if garbage else {})


@given(st.lists(st.one_of(st.none(), st.floats(allow_nan=True), st.integers(), st.text(max_size=3)), max_size=6),
       st.integers(0, 6))
def test_clean_scores_are_always_the_expected_count_of_finite_floats_or_none(values, expected):
    scores, problem = clean_scores(values, expected)
    assert len(scores) == expected
    assert all(score is None or (isinstance(score, float) and math.isfinite(score)) for score in scores)
    assert (problem is None) == (len(values) == expected and all(
        value is None or (not isinstance(value, str) and math.isfinite(float(value))) for value in values))


def test_a_hung_tool_raises_for_trl_to_answer_the_model_with_an_error():
    faults = FaultLog()
    bounded = guard_tool(lambda **_: time.sleep(30), "lookup", 0.2, faults)
    with pytest.raises(TaskTimeout, match=r"within TASK_TIMEOUT_S=0\.2s"):
        run(bounded(key="red"))
    assert counted(faults) == {"task/lookup/timeout_total": 1}
    assert run(guard_tool(lambda key: key.upper(), "lookup", 1, faults)(key="red")) == "RED"


class Game:
    def __init__(self) -> None:
        self.fail = False

    def reset(self, **row: Any) -> str:
        if row.get("boom"):
            raise RuntimeError("board missing")
        return "go"

    def get_reward(self) -> Any:
        return "won" if self.fail else 1.0


def test_a_crashed_environment_serves_no_observation_and_no_reward_until_a_good_reset():
    faults = FaultLog()
    game = guard_environment(Game(), 1, faults)
    assert game.reset(boom=True) is None and game.get_reward() is None
    assert game.reset() == "go" and game.get_reward() == 1.0
    game.fail = True
    assert game.get_reward() is None
    assert counted(faults) == {"task/Game.reset/error_total": 1, "task/Game.get_reward/garbage_total": 1}


def test_call_with_timeout_returns_and_raises_what_the_call_did():
    assert call_with_timeout(lambda a, b: a + b, 1, 2, b=3) == 5
    with pytest.raises(KeyError):
        call_with_timeout(raises, 1)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(0, 5), st.booleans())
def test_an_episode_keeps_a_version_the_fleet_still_serves(steps, max_staleness, pin):
    """Versions only grow; every turn's version is servable (TRL unloads v - (max_staleness + 1) on publishing v, a
    moment before the rollout process sees v); pinned, an episode mixes only when its version would not be."""
    newest, episode, chosen = 1, Episode(), []
    for step in steps:
        newest += step
        chosen.append(episode.version_for(newest, pin=pin, max_staleness=max_staleness))
    assert chosen == sorted(chosen)
    assert all(newest_at - version <= max(max_staleness - 1, 0)
               for newest_at, version in zip(_running(steps), chosen, strict=True))
    if not pin or max_staleness == 0:
        assert chosen == _running(steps)
    elif _running(steps)[-1] - 1 <= max_staleness - 1:
        assert not episode.mixed


def _running(steps: list[int]) -> list[int]:
    out, newest = [], 1
    for step in steps:
        newest += step
        out.append(newest)
    return out


# --- TRL's own rollout loop, in a thread, against a completion server -----------------------------------------


class _Completions(JsonStub):
    reply_ids: ClassVar[list[int]] = []
    models: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        body = self.json_body()
        type(self).models.append(body["model"])
        ids = type(self).reply_ids
        self.answer({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]})


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    time.sleep(30)  # hangs: TASK_TIMEOUT_S answers for it
    return key


class Board:
    def reset(self, **row: Any) -> None:
        raise RuntimeError("no board")

    def get_reward(self) -> float:
        return 1.0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from lorafleet_trainer.recipes import load_tokenizer

    return load_tokenizer(str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")))


@pytest.mark.parametrize("fault", ["reward_raises", "reward_hangs", "reward_garbage", "tool_hangs", "env_crashes"])
def test_trls_loop_keeps_scoring_whatever_the_task_code_does(fault, tokenizer, monkeypatch):
    from accelerate.state import PartialState
    from lorafleet_trainer.fleet_rollouts import FleetRolloutLoop, wire_rollouts
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    PartialState()  # as TRL's child does: its logger needs it

    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "red"}}\n</tool_call><|im_end|>'
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    _Completions.reply_ids = tokenizer.encode(call if fault == "tool_hangs" else "four<|im_end|>",
                                              add_special_tokens=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rewards = {"reward_raises": [raises], "reward_hangs": [hangs], "reward_garbage": [_nan_reward]}.get(
        fault, [_one_reward])
    worker = AsyncRolloutWorker(
        model_name="tiny", dataset=[{"prompt": [{"role": "user", "content": "2+2?"}]}], reward_funcs=rewards,
        tools=[lookup] if fault == "tool_hangs" else None,
        environment_factory=Board if fault == "env_crashes" else None,
        processing_class=tokenizer, eos_token_ids=[end], vllm_server_url=f"http://127.0.0.1:{server.server_port}",
        max_inflight_tasks=2, num_generations=2, request_timeout=5, max_tool_calling_iterations=1,
        lora_name="trl-policy",
    )  # fmt: skip
    from types import SimpleNamespace

    wire_rollouts(SimpleNamespace(rollout_worker=worker, accelerator=SimpleNamespace(is_main_process=True)), "",
                  load_settings(task_timeout_s=0.5))
    ctx = multiprocessing.get_context("spawn")
    samples, metrics = ctx.Queue(), queue.Queue()
    loop = FleetRolloutLoop(**worker._loop_kwargs, rollout_buffer=samples, model_version_value=ctx.Value("i", 1),
                            heartbeat_value=ctx.Value("d", 0.0), failed_event=threading.Event(),
                            exception_info_queue=queue.Queue(), metrics_queue=metrics)
    child = threading.Thread(target=loop.run, daemon=True)
    child.start()
    try:
        got = [samples.get(timeout=30) for _ in range(4)]  # two groups scored: the loop is alive
    finally:
        loop._loop.call_soon_threadsafe(loop._stop_event.set)
        child.join(timeout=30)
        server.shutdown()
    assert not loop._failed_event.is_set()
    totals: dict[str, float] = {}
    while not metrics.empty():
        for key, value in metrics.get().items():
            if key.startswith("task/"):
                totals[key] = totals.get(key, 0) + value
    expected = {"reward_raises": "task/raises/error_total", "reward_hangs": "task/hangs/timeout_total",
                "reward_garbage": "task/_nan_reward/garbage_total", "tool_hangs": "task/lookup/timeout_total",
                "env_crashes": "task/Board.reset/error_total"}[fault]
    assert totals.get(expected, 0) >= 1, totals
    if fault.startswith("reward"):
        assert all(math.isnan(sample.metrics["reward"]) and sample.advantage == 0 for sample in got)
    if fault == "env_crashes":  # no observation and no reward from a crashed board
        assert all(math.isnan(sample.metrics["rewards/Board"]) for sample in got)
    if fault == "tool_hangs":  # the model was answered with the timeout, and the episode went on
        assert any("TASK_TIMEOUT_S" in str(message.get("content")) for sample in got for message in sample.completion)
        assert set(_Completions.models) == {"trl-policy-v1"}


def _one_reward(completions: list[Any], **_: Any) -> list[float]:
    return [1.0] * len(completions)


def _nan_reward(completions: list[Any], **_: Any) -> list[float]:
    return [float("nan")] * len(completions)


def test_async_code_called_from_a_thread_runs_to_its_end_under_the_same_bound():
    async def double(x: int) -> int:
        await asyncio.sleep(0.01)
        return 2 * x

    class AsyncGame(Game):
        async def get_reward(self) -> float:  # type: ignore[override]
            return 0.5

    assert call_with_timeout(double, 2, 3) == 6
    with pytest.raises(TaskTimeout):
        call_with_timeout(hangs_async, 0.2)
    game = guard_environment(AsyncGame(), 1, FaultLog())
    assert game.reset() == "go" and game.get_reward() == 0.5


def test_timed_out_calls_are_abandoned_cleanly_and_hung_threads_stay_bounded(monkeypatch):
    """A long run of timed-out calls: no exception escapes any thread (a call ending after its caller's event loop
    closed delivers nothing), hung async code is cancelled in its own loop, hung sync code keeps at most
    MAX_HUNG_CALLS threads per function (later calls time out at once), and every thread ends once the code returns."""
    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    gate = threading.Event()

    def stuck(**_: Any) -> list[float]:
        gate.wait()
        return [1.0] * N

    def slow(**_: Any) -> list[float]:
        time.sleep(0.05)
        return [1.0] * N

    faults = FaultLog()
    baseline = threading.active_count()
    for _ in range(20):  # each in its own event loop, closed while the call still runs; it ends soon after
        assert run(guard_reward(slow, "slow", 0.001, faults)(**KWARGS)) == [None] * N
    for _ in range(200):
        assert run(guard_reward(stuck, "stuck", 0.001, faults)(**KWARGS)) == [None] * N
        assert threading.active_count() <= baseline + 2 * MAX_HUNG_CALLS
    assert hung_calls(stuck.__qualname__) == MAX_HUNG_CALLS
    for _ in range(100):
        with pytest.raises(TaskTimeout):
            call_with_timeout(hangs_async, 0.001)
        with pytest.raises(TaskTimeout):
            run(guard_tool(stuck, "stuck_tool", 0.001, faults)(key="red"))
    assert counted(faults) == {"task/slow/timeout_total": 20, "task/stuck/timeout_total": 200,
                               "task/stuck_tool/timeout_total": 100}
    gate.set()
    deadline = time.monotonic() + 10
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= baseline, [t.name for t in threading.enumerate()]
    assert hung_calls(stuck.__qualname__) == hung_calls(hangs_async.__qualname__) == 0
    assert run(guard_reward(stuck, "stuck", 1, faults)(**KWARGS)) == [1.0] * N  # called again once they returned
    assert escaped == []
