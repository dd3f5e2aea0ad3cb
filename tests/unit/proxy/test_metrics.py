"""The proxy's metric names and the bookkeeping behind the dashboard's sync row."""

from __future__ import annotations

from lorafleet_proxy.metrics import BROADCAST_OPS, Metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_names_follow_prometheus_conventions() -> None:
    for family in Metrics().registry.collect():
        assert family.name.startswith("lorafleet_proxy_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":  # a base unit: time, or the canary's log-probability distance
            assert family.name.endswith(("_seconds", "_nats")), family.name


def test_failures_and_rollbacks_exist_at_zero_before_any_broadcast() -> None:
    samples = _samples(Metrics())
    for op in BROADCAST_OPS:
        for outcome in ("ok", "rejected", "failed"):
            assert samples[("lorafleet_proxy_broadcasts_total", (("op", op), ("outcome", outcome)))] == 0
    assert samples[("lorafleet_proxy_broadcast_rollbacks_total", (("op", "load"),))] == 0


def test_broadcast_outcomes_by_status_class() -> None:
    metrics = Metrics()
    for status in (200, 400, 504, 502):
        metrics.broadcast_done("load", status, 0.1)
    samples = _samples(metrics)
    counts = {outcome: samples[("lorafleet_proxy_broadcasts_total", (("op", "load"), ("outcome", outcome)))]
              for outcome in ("ok", "rejected", "failed")}
    assert counts == {"ok": 1, "rejected": 1, "failed": 2}
    assert samples[("lorafleet_proxy_broadcast_duration_seconds_count", (("op", "load"),))] == 4


def test_a_pause_is_timed_until_the_resume() -> None:
    metrics = Metrics()
    metrics.track_pause(False)  # a load while running: no pause
    metrics.track_pause(True)
    metrics.track_pause(True)  # a load while paused: still the same pause
    assert _samples(metrics)[("lorafleet_proxy_fleet_paused", ())] == 1
    metrics.track_pause(False)
    metrics.track_pause(False)
    samples = _samples(metrics)
    assert samples[("lorafleet_proxy_pause_duration_seconds_count", ())] == 1
    assert samples[("lorafleet_proxy_pause_duration_seconds_sum", ())] > 0
    assert samples[("lorafleet_proxy_fleet_paused", ())] == 0
