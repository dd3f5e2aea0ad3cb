"""The pipeline benchmark's pure parts (bench/pipeline_bench.py): the arms and their alternating order, the window
a rate is timed over, the pooled rates, the ratio against TRL alone and the result's layout the docs page reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pipeline_bench import (
    ARM_KEYS,
    ArmRun,
    arm_order,
    arm_summary,
    arms_for,
    check_result,
    comparison,
    headline,
    window,
)

ROOT = Path(__file__).resolve().parents[3]
KEPT = ROOT / "bench" / "results" / "bench-pipeline.json"


def test_the_arms_differ_by_the_proxy_alone() -> None:
    trl, proxied, several, broadcast, lorafleet = arms_for(3)
    assert [arm.name for arm in (trl, proxied, several, broadcast, lorafleet)] == [
        "trl", "proxy-1", "proxy-3", "proxy-1-broadcast", "lorafleet-1"]
    assert (trl.proxy, trl.replicas, trl.lorafleet_train) == (False, 1, False)
    assert (proxied.proxy, proxied.replicas, proxied.lorafleet_train) == (True, 1, False)  # only the proxy differs
    assert proxied.sync_pause == several.sync_pause == lorafleet.sync_pause == "elide"  # the proxy's default
    assert (several.replicas, several.lorafleet_train) == (3, False)
    assert (broadcast.replicas, broadcast.sync_pause, broadcast.lorafleet_train) == (1, "broadcast", False)
    assert (lorafleet.proxy, lorafleet.replicas, lorafleet.lorafleet_train) == (True, 1, True)
    assert [arm.name for arm in arms_for(1, lorafleet_train=False)] == ["trl", "proxy-1", "proxy-1-broadcast"]
    with pytest.raises(ValueError, match="--replicas"):
        arms_for(0)


@given(st.integers(1, 6), st.integers(1, 7))
def test_every_arm_runs_once_a_round_and_the_order_alternates(replicas: int, repeats: int) -> None:
    arms = arms_for(replicas)
    order = arm_order(arms, repeats)
    assert len(order) == len(arms) * repeats
    for round_ in range(repeats):
        names = [arm.name for r, arm in order if r == round_]
        expected = [arm.name for arm in arms]
        assert names == (expected if round_ % 2 == 0 else expected[::-1])
    positions = {arm.name: [i for i, (_, a) in enumerate(order) if a == arm] for arm in arms}
    if repeats % 2 == 0:  # each arm's mean position in the run is the same: a drift weighs on all alike
        assert len({sum(p) for p in positions.values()}) == 1


def test_a_bad_repeat_count_is_refused() -> None:
    with pytest.raises(ValueError, match="--repeats"):
        arm_order(arms_for(2), 0)


def test_the_window_opens_at_the_first_step_and_skips_other_rows() -> None:
    rows = [{"step": 0, "time": 90.0}, {"step": 1, "time": 100.0, "reward": 0.1},
            {"step": 1, "time": 101.0, "eval/pass_at_1": 0.5}, {"step": 2, "time": 102.0, "reward": 0.2},
            {"step": 4, "time": 106.0, "reward": 0.3}]
    assert window(rows) == (3, 6.0)
    assert window(list(reversed(rows))) == (3, 6.0)
    with pytest.raises(ValueError, match="two optimizer steps"):
        window(rows[:2])


def _run(arm: str, steps: int, train_s: float, completions: float = 0.0, proxy_cpu_s: float | None = None) -> ArmRun:
    return ArmRun(arm, 0, steps, train_s, completions, train_s, train_s + 30, {"perf/step_s": train_s / steps},
                  {}, proxy_cpu_s)


def test_rates_are_pooled_over_the_rounds() -> None:
    summary = arm_summary([_run("trl", 10, 10.0, 100.0), _run("trl", 30, 50.0, 500.0)])
    assert summary["steps_per_hour"] == pytest.approx(3600 * 40 / 60)  # not the mean of 3600 and 2160
    assert summary["steps_per_hour_by_round"] == [3600.0, 2160.0]
    assert summary["rollouts_per_s"] == pytest.approx(10.0)
    assert summary["wall_s"] == pytest.approx(120.0)
    assert summary["proxy_cpu_s_per_step"] is None
    assert set(summary) == ARM_KEYS
    assert arm_summary([_run("proxy-1", 10, 10.0, proxy_cpu_s=2.0)])["proxy_cpu_s_per_step"] == pytest.approx(0.2)


@given(st.floats(1.0, 1e6), st.floats(0.0, 1e6))
def test_the_ratio_and_the_proxy_share_add_up_to_one(alone: float, proxied: float) -> None:
    result = comparison(alone, proxied)
    assert result["ratio"] == pytest.approx(proxied / alone, abs=1e-4)
    assert result["proxy_share"] == pytest.approx((alone - proxied) / alone, abs=1e-4)
    assert result["ratio"] + result["proxy_share"] == pytest.approx(1.0, abs=2e-4)


def test_the_goal_is_judged_on_proxy_1() -> None:
    arms = {"trl": {"steps_per_hour": 1000.0}, "proxy-1": {"steps_per_hour": 985.0},
            "proxy-2": {"steps_per_hour": 1500.0}}
    result = headline(arms)
    assert result["vs_trl"]["proxy-1"] == {"ratio": 0.985, "proxy_share": 0.015}
    assert result["vs_trl"]["proxy-2"]["ratio"] == 1.5
    assert set(result["vs_trl"]) == {"proxy-1", "proxy-2"}
    assert result["goal_met"] is True
    arms["proxy-1"]["steps_per_hour"] = 970.0
    assert headline(arms)["goal_met"] is False
    with pytest.raises(ValueError, match="positive"):
        comparison(0.0, 1.0)


def test_the_kept_result_has_the_layout_the_page_renders() -> None:
    result = json.loads(KEPT.read_text())
    check_result(result)
    alone, proxied = result["arms"]["trl"]["steps_per_hour"], result["arms"]["proxy-1"]["steps_per_hour"]
    assert result["headline"]["vs_trl"]["proxy-1"]["ratio"] == pytest.approx(proxied / alone, abs=1e-4)
    assert result["order"] == [f"{r}:{arm.name}" for r, arm in arm_order(
        arms_for(result["parameters"]["replicas"], result["parameters"]["lorafleet_train"]),
        result["parameters"]["repeats"])]


def test_a_result_missing_what_the_page_renders_is_refused() -> None:
    result = json.loads(KEPT.read_text())
    broken = {**result, "arms": {**result["arms"], "trl": {"steps_per_hour": 1.0}}}
    with pytest.raises(ValueError, match="arm trl"):
        check_result(broken)
    with pytest.raises(ValueError, match="lacks"):
        check_result({key: value for key, value in result.items() if key != "headline"})
