"""The trainer's Prometheus exporter: TRL's logged values become lorafleet_trainer_* metrics over real HTTP."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
from lorafleet.adapters import lora_dir
from lorafleet.ports import free_port
from lorafleet.settings import load_settings
from lorafleet_trainer.exporter import PrometheusExporter, exporter_callbacks
from prometheus_client.parser import text_string_to_metric_families

LOGS = {"reward": 0.25, "ratio": 1.001, "kl": 0.002, "sample/staleness_mean": 1.5, "sample/staleness_max": 3.0,
        "perf/step_s": 2.0, "perf/weight_sync_s": 0.4, "sample/dropped_stale_total": 3.0, "loss": float("nan")}


def _samples(text: str) -> dict[str, float]:
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if not sample.labels}


def test_logged_values_are_served_over_http(tmp_path: Path) -> None:
    port = free_port()
    settings = load_settings(adapter_root=tmp_path, run_name="r", trainer_metrics_port=port)
    exporter = PrometheusExporter(settings)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    exporter.on_train_begin(None, state, None)
    url = f"http://127.0.0.1:{port}/metrics"

    before = _samples(httpx.get(url).text)
    assert "lorafleet_trainer_reward" not in before  # no made-up value before the first log
    assert before["lorafleet_trainer_dropped_stale_samples_total"] == 0

    (lora_dir(tmp_path, "r") / "trl-policy-v3").mkdir(parents=True)
    (lora_dir(tmp_path, "r") / "trl-policy-v12").mkdir()
    for step in (1, 2):
        state.global_step = step
        exporter.on_log(None, state, None, logs=dict(LOGS))
    after = _samples(httpx.get(url).text)
    assert after["lorafleet_trainer_reward"] == 0.25
    assert after["lorafleet_trainer_importance_ratio"] == 1.001
    assert after["lorafleet_trainer_kl"] == 0.002
    assert after["lorafleet_trainer_staleness_versions"] == 1.5
    assert after["lorafleet_trainer_step"] == 2
    assert after["lorafleet_trainer_policy_version"] == 12
    assert after["lorafleet_trainer_dropped_stale_samples_total"] == 6  # TRL logs per-window deltas
    assert after["lorafleet_trainer_step_duration_seconds_count"] == 2
    assert after["lorafleet_trainer_step_duration_seconds_sum"] == 4.0
    assert after["lorafleet_trainer_weight_sync_duration_seconds_sum"] == 0.8


def test_port_zero_is_off_and_a_busy_port_does_not_stop_training(tmp_path: Path) -> None:
    assert exporter_callbacks(load_settings(adapter_root=tmp_path, trainer_metrics_port=0)) == []
    port = free_port()
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    first = PrometheusExporter(load_settings(adapter_root=tmp_path, trainer_metrics_port=port))
    first.on_train_begin(None, state, None)
    second = PrometheusExporter(load_settings(adapter_root=tmp_path, trainer_metrics_port=port))
    second.on_train_begin(None, state, None)
    assert first.serving and not second.serving


def test_only_the_main_process_serves(tmp_path: Path) -> None:
    exporter = PrometheusExporter(load_settings(adapter_root=tmp_path, trainer_metrics_port=free_port()))
    exporter.on_train_begin(None, SimpleNamespace(is_world_process_zero=False, global_step=0), None)
    assert not exporter.serving


def test_eval_results_and_per_function_rewards_are_gauges(tmp_path: Path) -> None:
    from lorafleet_trainer.exporter import TrainerMetrics
    from prometheus_client import generate_latest

    metrics = TrainerMetrics(tmp_path)
    metrics.record({"reward": 0.5, "rewards/says_yes": 0.75, "rewards/short": 0.25, "eval/pass_at_1": 0.5,
                    "eval/reward": 1.25, "eval/model_version": 4.0, "eval/rewards/says_yes": 1.0}, step=10)
    families = {family.name: family for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    assert families["lorafleet_trainer_eval_pass_at_1"].samples[0].value == 0.5
    assert families["lorafleet_trainer_eval_reward"].samples[0].value == 1.25
    assert families["lorafleet_trainer_eval_policy_version"].samples[0].value == 4
    by_function = {s.labels["function"]: s.value for s in families["lorafleet_trainer_reward_by_function"].samples}
    assert by_function == {"says_yes": 0.75, "short": 0.25}
    assert {s.labels["function"]: s.value for s in families["lorafleet_trainer_eval_reward_by_function"].samples} == {
        "says_yes": 1.0}
