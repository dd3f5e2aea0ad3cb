"""`lorafleet-train` for real on CPU: the tiny recipe through the real proxy in front of two real float32 replicas.

The session's shared float32 replicas behind a proxy of this module's own (own ADAPTER_ROOT and
ledger). Run 1 (the module fixture `first_run`) trains 3 steps; run 2 resumes its checkpoint; then
two runs the fleet cannot serve are refused before anything is published.
Both runs train at RATIO_LR, so their importance ratio must be 1 within RATIO_TOL (ratio_bounds.py says why).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lorafleet.adapters import lora_dir, policy_name, policy_version
from lorafleet.ledger_format import fingerprint
from lorafleet.ratio_outliers import METRICS_KEY, RatioWatch, read_rows, steps
from lorafleet_ops.commands.status import read_metrics
from lorafleet_ops.processes import Service
from lorafleet_testing.process_tier import stored_at
from lorafleet_testing.trainers import finish
from lorafleet_trainer.provenance import ROLLOUTS_FILE
from lorafleet_trainer.ratio_by_replica import UNATTRIBUTED_KEY
from ratio_bounds import RATIO_LR, near_one

# Session replicas may boot inside the first test (up to STARTUP_TIMEOUT_S), then a run of up to RUN_TIMEOUT_S.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

RUN = "trainer-it"
STEPS = 3
RUN_TIMEOUT_S = 600  # the acceptance budget for 3 steps on CI


def _train(start_trainer: Callable[..., Service], name: str, root: Path, proxy: Service,
           **settings: Any) -> tuple[int, str]:
    return finish(start_trainer(name, root, RUN, proxy.url, HF_HUB_OFFLINE="1", **settings), RUN_TIMEOUT_S)


def _metrics(root: Path) -> list[dict[str, Any]]:
    return [row for row in read_metrics(root / "runs" / RUN / "metrics.jsonl") if "ratio" in row]


@pytest.fixture(scope="module")
def first_run(fleet, root, start_trainer) -> str:
    """Run 1: 3 steps with a checkpoint at the last one (run 2 resumes it). Returns the trainer's log."""
    _, proxy = fleet
    code, log = _train(start_trainer, "trainer-run1", root, proxy, MAX_STEPS=STEPS, SAVE_STEPS=STEPS,
                       LEARNING_RATE=RATIO_LR)
    assert code == 0, log[-4000:]
    return log


def test_tiny_recipe_trains_3_steps_and_publishes_each_version_on_both_replicas(
    first_run, fleet, root, served_adapters
):
    replicas, _ = fleet
    log = first_run

    assert "Adapter-only vLLM sync enabled" in log  # the trl logger has a handler
    assert "Falling back" not in log and "merged" not in log
    assert "replicas=2" in log  # learnt from the proxy's /fleet
    rows = _metrics(root)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    ratios = [row["ratio"] for row in rows]
    assert near_one(ratios), ratios
    assert all(row["perf/weight_sync_s"] > 0 for row in rows)

    # Cold sync = v1, then one sync per step (the tiny recipe's WEIGHT_SYNC_STEPS=1): v1..v4, all still loaded.
    published = {policy_name(v): stored_at(root, lora_dir(root, RUN) / policy_name(v)) for v in range(1, STEPS + 2)}
    for replica in replicas:
        assert served_adapters(replica.url) == published, replica.url
    assert (root / "runs" / RUN / "final-adapter" / "adapter_config.json").is_file()
    assert (root / "runs" / RUN / f"checkpoint-{STEPS}" / "rollout_state.json").is_file()


def test_every_rollout_read_names_the_replica_adapter_and_fingerprint_that_answered_it(first_run, fleet, root):
    """Issue 54, part 1: rollouts.jsonl, one line per sample the trainer read, with the proxy's provenance."""
    replicas, _ = fleet
    lines = [json.loads(line) for line in (root / "runs" / RUN / ROLLOUTS_FILE).read_text().splitlines()]
    assert lines
    answers = [answer for line in lines for answer in line["answers"]]
    # One answer per turn (the tiny model now and then calls a tool: two turns); a row trains at most their tokens.
    assert all(line["answers"] and 0 < line["tokens"] <= sum(a["tokens"] for a in line["answers"]) for line in lines)
    assert {answer["replica"] for answer in answers} <= {replica.url for replica in replicas}
    assert all(policy_version(answer["adapter"]) for answer in answers), answers[:4]
    for name in {answer["adapter"] for answer in answers}:
        folder = lora_dir(root, RUN) / name
        seen = {answer["fingerprint"] for answer in answers if answer["adapter"] == name}
        if folder.is_dir():  # not yet removed by retention
            assert seen == {fingerprint(folder)}, name


def test_the_ratio_per_replica_adds_up_to_the_fleet_ratio_and_names_no_healthy_replica(first_run, fleet, root):
    """Issue 54, part 2: every logged window has rows per (replica, version) whose token-weighted ratio is TRL's
    fleet-wide `ratio` (a mean of micro-batch means, hence the tolerance), and two healthy replicas never depart."""
    replicas, _ = fleet
    watch = RatioWatch()
    for line in _metrics(root):
        rows = read_rows(line[METRICS_KEY])
        tokens = sum(row.tokens for row in rows)
        assert rows and {row.replica for row in rows} <= {replica.url for replica in replicas}, line
        assert line[UNATTRIBUTED_KEY] <= 0.1 * tokens  # only a rollout whose turns two replicas answered
        assert abs(sum(row.tokens * row.ratio_mean for row in rows) / tokens - line["ratio"]) < 1e-3, line
        assert watch.judge(rows) == [], line
        excess = max((abs(step.excess) for step in steps(rows)), default=0.0)
        print(f"step {line['step']}: largest divergence between healthy replicas {excess:.5f} nats")


def test_second_start_resumes_the_checkpoint_and_keeps_version_numbering(
    first_run, fleet, root, start_trainer, served_adapters
):
    replicas, proxy = fleet
    code, log = _train(start_trainer, "trainer-run2", root, proxy, MAX_STEPS=STEPS + 2, LEARNING_RATE=RATIO_LR)
    assert code == 0, log[-4000:]
    assert f"event=resuming checkpoint={root / 'runs' / RUN / f'checkpoint-{STEPS}'}" in log
    assert "model_version=4" in log
    assert "event=swept_stale_policies" in log  # run 1's names were unloaded before the new cold sync
    assert "already been loaded" not in log
    rows = _metrics(root)
    assert [row["step"] for row in rows][-2:] == [STEPS + 1, STEPS + 2]
    assert near_one([row["ratio"] for row in rows[-2:]]), rows[-2:]
    # Numbering continued after v4: cold sync v5, then v6 and v7; nothing older is loaded any more.
    expected = {policy_name(v): stored_at(root, lora_dir(root, RUN) / policy_name(v)) for v in (5, 6, 7)}
    for replica in replicas:
        assert served_adapters(replica.url) == expected, replica.url


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"MAX_STALENESS": "5"}, "Restart the server with `--max-loras 7`, or lower `max_staleness`"),
        ({"LORA_RANK": "16"}, "Restart it with `--max-lora-rank 16`"),
    ],
)
def test_a_fleet_that_cannot_serve_adapter_only_sync_is_refused(
    fleet, root, start_trainer, served_adapters, settings, reason
):
    replicas, proxy = fleet
    before = {replica.url: served_adapters(replica.url) for replica in replicas}
    code, log = _train(start_trainer, "trainer-refused", root, proxy, RUN_NAME="refused", **settings)
    assert code == 3, log[-4000:]
    assert "event=refused" in log and "refusing to start" in log and reason in log
    assert not (root / "runs" / "refused").exists()  # nothing trained, nothing published
    assert {replica.url: served_adapters(replica.url) for replica in replicas} == before
