"""The real-model benchmark's pure parts (bench/real_model_bench.py): one seed's row and its goal, the spread over
the seeds, the plot; and the kept result agrees with itself (every seed's change from its own evaluations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_model_bench import GOAL_POINTS, GOAL_WALL_S, plot, seed_row, spread

pytestmark = pytest.mark.timeout(120)
KEPT = Path(__file__).resolve().parents[3] / "bench" / "results" / "bench-real-model.json"


def report(passes: list[float], every: int = 5) -> dict:
    """A demo report's fields the benchmark reads (lorafleet_ops.commands.demo.run_report's layout)."""
    evals = [{"step": max(1, i * every), "pass_at_1": p, "nonzero": {"correct": p}} for i, p in enumerate(passes)]
    change = round(100 * (passes[-1] - passes[0]), 1)
    return {"steps": evals[-1]["step"], "eval": evals, "reward": {"first_steps_mean": 0.1},
            "eval_pass_at_1": {"first": passes[0], "last": passes[-1], "best": max(passes), "change_points": change},
            "sync": {"steps_per_minute": 2.0}, "doctor_failed": []}


def test_a_seed_meets_the_goal_only_with_enough_points_at_its_last_eval_and_in_time():
    gain = GOAL_POINTS / 100
    assert seed_row(0, report([0.2, 0.9, 0.2 + gain]), 60.0, {"1m": 1.0})["goal_met"]
    assert not seed_row(1, report([0.2, 0.9, 0.2 + gain - 0.02]), 60.0, {"1m": 1.0})["goal_met"]  # best is not last
    assert not seed_row(2, report([0.2, 0.2 + 2 * gain]), GOAL_WALL_S + 1, {"1m": 1.0})["goal_met"]  # too slow
    assert not seed_row(3, {"steps": 0}, 60.0, {"1m": 1.0})["goal_met"]  # no evaluation: not met
    row = seed_row(4, report([0.1, 0.4]), 61.26, {"1m": 3.5})
    assert row["wall_s"] == 61.3 and row["load_before"] == {"1m": 3.5} and set(row["load_after"]) == {"1m", "5m", "15m"}


def test_the_spread_covers_the_finished_seeds_and_skips_a_failed_one():
    rows = [seed_row(0, report([0.1, 0.4]), 60.0, {}), seed_row(1, report([0.2, 0.3]), 60.0, {}),
            {"seed": 2, "wall_s": 5.0, "error": "the trainer of run demo failed"}]
    found = spread(rows)
    assert found["first"] == {"min": 0.1, "mean": 0.15, "max": 0.2}
    assert found["change_points"]["min"] == 10.0 and found["change_points"]["max"] == 30.0
    assert found["seeds_meeting_goal"] == 1


def test_the_plot_draws_every_seed_even_of_different_lengths(tmp_path):
    rows = [seed_row(0, report([0.1, 0.4, 0.5]), 60.0, {}), seed_row(1, report([0.2, 0.3]), 60.0, {}),
            {"seed": 2, "wall_s": 5.0, "error": "failed"}]
    plot(rows, tmp_path / "seeds.png")
    assert (tmp_path / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not KEPT.exists(), reason="no kept bench-real-model.json yet")
def test_the_kept_result_agrees_with_its_own_evaluations():
    result = json.loads(KEPT.read_text())
    finished = [row for row in result["seeds"] if "error" not in row]
    assert result["seeds_completed"] == [row["seed"] for row in finished]
    for row in finished:
        passes = [e["pass_at_1"] for e in row["eval"]]
        assert row["eval_pass_at_1"]["change_points"] == round(100 * (passes[-1] - passes[0]), 1)
        assert row["goal_met"] == (row["eval_pass_at_1"]["change_points"] >= result["goal"]["min_change_points"]
                                   and row["wall_s"] <= result["goal"]["max_wall_s"])
    assert spread(result["seeds"]) == result["spread"]
