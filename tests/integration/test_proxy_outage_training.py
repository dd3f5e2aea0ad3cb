"""The proxy gone under training (issue 34), on real processes: two real trainers (runs `a` and `b`, each with its
run key) on the session's real replicas, the proxy's process killed (SIGKILL) mid-training and the fleet left
unreachable for 60 s (and until each trainer has met the outage and logged its wait: one busy with a step meets it at
its next sync, however slow the machine) before the proxy starts again.

Both trainers wait (their rollouts and control calls retry, logged, within TRAINER_FLEET_WAIT_S) and train on
past the outage, then stop cleanly; every step is trained once, in order; the ledger the restarted proxy restored
and what every replica serves agree. How soon the restarted proxy serves is measured and printed
(docs/guides/preemption.md#the-proxy-gone).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from lorafleet.adapters import run_dir
from lorafleet.run_key_store import provision, write_private
from lorafleet_ops.commands.status import read_metrics
from lorafleet_ops.processes import Service

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

RUNS = ("a", "b")
STEPS = 10_000  # a bound only: the test stops both runs once each has trained on past the outage
KILL_AT_STEP = 2
STEPS_AFTER = 3
OUTAGE_S = 60.0  # the fleet unreachable at least this long, and until each trainer has met the outage (MET_OUTAGE_S)
MET_OUTAGE_S = 240.0  # a trainer busy with a step meets it at its next sync; under TRAINER_FLEET_WAIT_S=300
FLEET_WAIT_LINE = "waiting for the fleet"  # in the rollouts' retries and the control calls' (control_call_waiting)
RUN_TIMEOUT_S = 900


def steps(root: Path, run: str) -> list[int]:
    """The steps a run logged, one row each (the rows with the importance ratio)."""
    return [int(row["step"]) for row in read_metrics(run_dir(root, run) / "metrics.jsonl") if "ratio" in row]


def wait_for(condition: Callable[[], bool], what: str, trainers: dict[str, Service], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for run, trainer in trainers.items():
            assert trainer.alive, f"trainer {run} ended while waiting for {what}:\n{trainer.log_tail(60)}"
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.5)


def test_two_runs_wait_out_a_killed_proxy_and_a_minute_without_a_fleet(shared_replicas, start_proxy, start_trainer,
                                                                        served_adapters, root, log_dir) -> None:
    keys = {}
    for run in RUNS:
        keys[run] = root / f"{run}.key"
        write_private(keys[run], provision(root / "run-keys", run))
    proxy_env = {"RUN_KEYS_DIR": str(root / "run-keys")}
    proxy = start_proxy(shared_replicas, root=root, **proxy_env)
    port = int(proxy.url.rsplit(":", 1)[1])
    trainers: dict[str, Service] = {}
    for run in RUNS:  # one after the other: two pre-training doctors probing at once read each other's pauses
        trainers[run] = start_trainer(f"trainer-outage-{run}", root, run, f"{proxy.url}/runs/{run}", MAX_STEPS=STEPS,
                                      MAX_STALENESS=1, TRAINER_RUN_KEY_FILE=keys[run], TRAINER_FLEET_WAIT_S=300,
                                      MAX_MODEL_LEN=512, HF_HUB_OFFLINE="1")
        wait_for(lambda run=run: "event=doctor_passed" in trainers[run].log_path.read_text(),
                 f"run {run}'s pre-training doctor", trainers, 300)
    try:
        wait_for(lambda: all(len(steps(root, run)) >= KILL_AT_STEP for run in RUNS), "both runs training", trainers,
                 600)
        killed_at = time.monotonic()
        proxy.kill()  # the proxy's process dies: every connection refused
        wait_for(lambda: all(FLEET_WAIT_LINE in trainer.log_path.read_text() for trainer in trainers.values()),
                 "both trainers logging their wait for the fleet", trainers, MET_OUTAGE_S)
        time.sleep(max(0.0, killed_at + OUTAGE_S - time.monotonic()))
        for run, trainer in trainers.items():
            assert trainer.alive, f"trainer {run} gave up during the outage:\n{trainer.log_tail(60)}"
        started = time.monotonic()
        proxy = start_proxy(shared_replicas, root=root, port=port, **proxy_env)
        healthy_s = time.monotonic() - started
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "back", "max_tokens": 1}, timeout=60)
        serving_s = time.monotonic() - started
        assert answer.status_code == 200, answer.text
        (log_dir / "proxy-outage.json").write_text(json.dumps(
            {"outage_s": OUTAGE_S, "healthy_after_start_s": round(healthy_s, 2),
             "first_completion_after_start_s": round(serving_s, 2)}))
        print(f"restarted proxy: healthy {healthy_s:.2f} s, first completion {serving_s:.2f} s after its start")
        at_restart = {run: len(steps(root, run)) for run in RUNS}
        wait_for(lambda: all(len(steps(root, run)) >= at_restart[run] + STEPS_AFTER for run in RUNS),
                 "both runs training after the outage", trainers, RUN_TIMEOUT_S)
        for trainer in trainers.values():
            trainer.process.send_signal(signal.SIGTERM)  # a clean stop: checkpoint, exit 0
        codes = {run: trainer.process.wait(timeout=RUN_TIMEOUT_S) for run, trainer in trainers.items()}
    finally:
        for trainer in trainers.values():
            trainer.stop()
    logs = {run: trainer.log_path.read_text() for run, trainer in trainers.items()}
    assert codes == dict.fromkeys(RUNS, 0), {run: logs[run][-3000:] for run in RUNS if codes[run]}
    for run in RUNS:
        logged = steps(root, run)
        assert logged == list(range(1, len(logged) + 1)), f"run {run}: steps repeated or skipped: {logged}"
        assert keys[run].read_text().strip() not in logs[run]
    fleet = httpx.get(proxy.url + "/fleet", timeout=10).json()
    ledger = {entry["name"]: entry["path"] for entry in fleet["ledger"]}
    assert {name.split("--")[0] for name in ledger} == set(RUNS), ledger
    for replica in shared_replicas:
        assert served_adapters(replica.url) == ledger, replica.url
    for run in RUNS:  # leave the shared replicas clean
        auth = {"Authorization": f"Bearer {keys[run].read_text().strip()}"}
        base = f"{proxy.url}/runs/{run}"
        for card in httpx.get(base + "/v1/models", headers=auth, timeout=10).json()["data"][1:]:
            httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, headers=auth, timeout=60)
    proxy.stop()
