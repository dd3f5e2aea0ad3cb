"""The trainer's Prometheus metrics: TRL's logged values on a port of their own (TRAINER_METRICS_PORT).

Fed by the same hook as metrics.jsonl (transformers' `on_log`), so Prometheus and the file see the
same numbers. A logged window is reduced by TRL (means, sums for `*_total`, extrema): gauges hold
the last window's value and appear only once logged (no made-up zero before the first step);
durations are histograms of the logged values; dropped stale samples a counter. The current
policy version is the newest `trl-policy-vN` published under the run's `.vllm_lora` folder. The ratio per replica
(`ratio_by_replica` rows, ratio_by_replica.py) is a gauge per `replica` and `version` label, kept for the newest
REPLICA_VERSIONS_KEPT versions only, so the series stay bounded over a run of thousands of versions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorafleet.adapters import lora_dir, policy_version
from lorafleet.logs import log_event
from lorafleet.ratio_outliers import METRICS_KEY, ReplicaRatio, read_rows
from lorafleet.settings import TrainerSettings
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from transformers import TrainerCallback

log = logging.getLogger(__name__)

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
# TRL's logged key -> (gauge name, help): the last logged window's value.
GAUGES = {
    "reward": ("lorafleet_trainer_reward", "Mean reward of the last logged window."),
    "reward_std": ("lorafleet_trainer_reward_std", "Reward standard deviation of the last logged window."),
    "ratio": ("lorafleet_trainer_importance_ratio",
              "Mean importance ratio exp(logp_train - logp_vllm); 1.0 = trainer and replicas agree."),
    "kl": ("lorafleet_trainer_kl", "Mean KL to the rollout policy in the last logged window."),
    "sample/staleness_mean": ("lorafleet_trainer_staleness_versions",
                              "Mean policy versions a trained sample lagged behind (last window)."),
    "sample/staleness_max": ("lorafleet_trainer_staleness_max_versions",
                             "Largest policy-version lag of a trained sample (last window)."),
    "sample/rollout_queue_size": ("lorafleet_trainer_rollout_queue_samples", "Scored rollouts waiting to train."),
    "eval/pass_at_1": ("lorafleet_trainer_eval_pass_at_1",
                       "Share of the task's eval set whose greedy reward reached its pass threshold (last eval)."),
    "eval/reward": ("lorafleet_trainer_eval_reward", "Mean greedy reward over the task's eval set (last eval)."),
    "eval/model_version": ("lorafleet_trainer_eval_policy_version", "Policy version the last eval scored."),
}
# ReplicaRatio's field -> (gauge name, help), labelled replica and version.
BY_REPLICA = {
    "log_ratio_mean": ("lorafleet_trainer_replica_log_ratio",
                       "Mean log-ratio log p_train - log p_replica of the tokens one replica generated for one version "
                       "(last window with such tokens); 0 = agrees with the trainer."),
    "abs_log_ratio_mean": ("lorafleet_trainer_replica_abs_log_ratio",
                           "Mean |log-ratio| of the tokens one replica generated for one version."),
    "log_ratio_std": ("lorafleet_trainer_replica_log_ratio_std",
                      "Standard deviation of the log-ratio of the tokens one replica generated for one version."),
    "ratio_mean": ("lorafleet_trainer_replica_importance_ratio",
                   "Mean importance ratio exp(log-ratio) of one replica's tokens for one version: its share of "
                   "lorafleet_trainer_importance_ratio."),
    "tokens": ("lorafleet_trainer_replica_ratio_tokens", "Tokens behind the replica's ratio gauges (that window)."),
}
REPLICA_VERSIONS_KEPT = 4  # the newest versions with per-replica series
EVAL_BY_FUNCTION = "eval/rewards/"  # eval/rewards/<function>: one labelled gauge
TRAIN_BY_FUNCTION = "rewards/"  # TRL's rewards/<function>: the window's mean
# TRL's logged key -> (histogram name, help): one observation per logged window.
DURATIONS = {
    "perf/step_s": ("lorafleet_trainer_step_duration_seconds", "Wall-clock time of one optimizer step."),
    "perf/weight_sync_s": ("lorafleet_trainer_weight_sync_duration_seconds",
                           "Adapter publication: pause, save, load on the fleet, resume, unload."),
    "perf/rollout_wait_s": ("lorafleet_trainer_rollout_wait_duration_seconds",
                            "Time a step waited for rollouts (generation-bound when high)."),
}


def _function(key: str, prefix: str) -> str | None:
    """The reward function a per-function key is about (None when it is not one of `prefix`'s)."""
    return key[len(prefix):] or None if key.startswith(prefix) else None


class TrainerMetrics(Collector):
    """The registry the exporter serves: gauges from the last log, histograms and counters since start."""

    def __init__(self, lora_root: Path) -> None:
        self.lora_root = lora_root
        self.registry = CollectorRegistry()
        self.values: dict[str, float] = {}
        self.by_replica: dict[tuple[str, int], ReplicaRatio] = {}
        self.step: int | None = None
        self.durations = {key: Histogram(name, doc, buckets=DURATION_BUCKETS, registry=self.registry)
                          for key, (name, doc) in DURATIONS.items()}
        self.dropped_stale = Counter("lorafleet_trainer_dropped_stale_samples",
                                     "Rollouts dropped for lagging more than MAX_STALENESS versions.",
                                     registry=self.registry)
        self.registry.register(self)

    def record(self, logs: dict[str, Any], step: int) -> None:
        """One logged window (transformers' `logs` dict) at optimizer step `step`."""
        numbers = {key: float(value) for key, value in logs.items()
                   if isinstance(value, int | float) and math.isfinite(value)}
        self.values.update({key: value for key, value in numbers.items() if key in GAUGES
                            or key.startswith((EVAL_BY_FUNCTION, TRAIN_BY_FUNCTION))})
        for key, histogram in self.durations.items():
            if key in numbers:
                histogram.observe(numbers[key])
        self.dropped_stale.inc(numbers.get("sample/dropped_stale_total", 0.0))
        self.by_replica.update({(row.replica, row.version): row for row in read_rows(logs.get(METRICS_KEY))})
        kept = sorted({version for _, version in self.by_replica})[-REPLICA_VERSIONS_KEPT:]
        self.by_replica = {key: row for key, row in self.by_replica.items() if key[1] in kept}
        self.step = step

    def published_version(self) -> int | None:
        """The newest policy version published for this run (None before the first sync)."""
        if not self.lora_root.is_dir():
            return None
        versions = [policy_version(entry.name) for entry in self.lora_root.iterdir()]
        return max((v for v in versions if v is not None), default=None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for key, (name, doc) in GAUGES.items():
            if key in self.values:
                yield GaugeMetricFamily(name, doc, value=self.values[key])
        for prefix, name, doc in (
            (EVAL_BY_FUNCTION, "lorafleet_trainer_eval_reward_by_function", "Mean greedy eval reward of one function."),
            (TRAIN_BY_FUNCTION, "lorafleet_trainer_reward_by_function", "Mean training reward of one function."),
        ):
            family = GaugeMetricFamily(name, doc, labels=["function"])
            for key, value in sorted(self.values.items()):
                function = _function(key, prefix)
                if function:
                    family.add_metric([function], value)
            if family.samples:
                yield family
        for field, (name, doc) in BY_REPLICA.items():
            family = GaugeMetricFamily(name, doc, labels=["replica", "version"])
            for (replica, version), row in sorted(self.by_replica.items()):
                family.add_metric([replica, str(version)], float(getattr(row, field)))
            if family.samples:
                yield family
        if self.step is not None:
            yield GaugeMetricFamily("lorafleet_trainer_step", "Optimizer step of the last log.", value=self.step)
        version = self.published_version()
        if version is not None:
            yield GaugeMetricFamily("lorafleet_trainer_policy_version",
                                    "Newest policy version (trl-policy-vN) published to the fleet.", value=version)


class PrometheusExporter(TrainerCallback):
    """Serves TrainerMetrics over HTTP from the main process once training begins (rank 0 only)."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.host, self.port = settings.trainer_metrics_host, settings.trainer_metrics_port
        self.metrics = TrainerMetrics(lora_dir(settings.adapter_root, settings.run_name))
        self.serving = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.serving or not state.is_world_process_zero:
            return
        try:
            start_http_server(self.port, addr=self.host, registry=self.metrics.registry)
        except OSError as exc:  # observability must not stop a run
            log_event(log, "metrics_unavailable", logging.WARNING, port=self.port, reason=str(exc))
            return
        self.serving = True
        log_event(log, "metrics_serving", url=f"http://{self.host}:{self.port}/metrics")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if logs and state.is_world_process_zero:
            self.metrics.record(logs, state.global_step)


def exporter_callbacks(settings: TrainerSettings) -> list[TrainerCallback]:
    """[PrometheusExporter] when TRAINER_METRICS_PORT is set, [] when it is 0 (off)."""
    return [PrometheusExporter(settings)] if settings.trainer_metrics_port else []
