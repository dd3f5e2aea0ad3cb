"""The ratio per replica as its readers see it (issue 54, part 2): which replica departs (lorafleet.ratio_outliers),
`make status`'s table, the doctor's ratio check and the exporter's labelled gauges, all from metrics.jsonl's rows."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from lorafleet.ratio_outliers import (
    DEPARTURE_FLOOR_NATS,
    METRICS_KEY,
    MIN_TOKENS,
    ReplicaRatio,
    outliers,
    pooled,
    read_rows,
    reference,
)
from lorafleet_ops.commands.doctor.checks import check_ratio
from lorafleet_ops.commands.doctor.model import Snapshot, Status
from lorafleet_ops.commands.status import render_ratio_by_replica
from lorafleet_trainer.exporter import REPLICA_VERSIONS_KEPT, TrainerMetrics


def _row(replica: str, mean: float, version: int = 3, tokens: int = 400, std: float = 0.01) -> ReplicaRatio:
    return ReplicaRatio(replica=replica, version=version, tokens=tokens, log_ratio_mean=mean,
                        abs_log_ratio_mean=abs(mean) + std, log_ratio_std=std, ratio_mean=1.0 + mean)


noise = st.floats(-DEPARTURE_FLOOR_NATS / 2.1, DEPARTURE_FLOOR_NATS / 2.1)


@given(st.lists(noise, min_size=1, max_size=8), st.floats(-0.05, 0.05))
def test_healthy_replicas_within_the_floor_of_each_other_are_never_named(means: list[float], drift: float) -> None:
    rows = [_row(f"http://r{index}", drift + mean) for index, mean in enumerate(means)]
    assert outliers(rows) == []


@given(st.lists(noise, min_size=2, max_size=7), st.floats(2.5 * DEPARTURE_FLOOR_NATS, 2.0), st.booleans(),
       st.floats(-0.01, 0.01))
def test_one_replica_with_other_weights_is_named_alone(means: list[float], departure: float, below: bool,
                                                        drift: float) -> None:
    healthy = [_row(f"http://r{index}", drift + mean) for index, mean in enumerate(means)]
    odd = _row("http://odd", drift + (-departure if below else departure))
    found = outliers([*healthy, odd])
    assert [item.replica for item in found] == ["http://odd"]
    assert "http://odd on v3" in found[0].evidence()


def test_of_two_replicas_that_disagree_the_one_the_trainer_scores_farther_is_named() -> None:
    rows = [_row("http://a", 0.004), _row("http://b", -0.3)]
    assert reference(rows) == 0.004
    assert [item.replica for item in outliers(rows)] == ["http://b"]


def test_versions_are_judged_apart_and_small_or_lone_samples_not_at_all() -> None:
    rows = [_row("http://a", 0.0, version=2), _row("http://c", 0.9, version=4),  # alone on their versions
            _row("http://a", 0.0, version=3), _row("http://b", 0.5, version=3),
            _row("http://c", 3.0, version=3, tokens=MIN_TOKENS - 1)]  # too few tokens to judge
    assert [(item.replica, item.version) for item in outliers(rows)] == [("http://b", 3)]


def test_a_noisy_window_widens_the_bound_past_the_floor() -> None:
    noisy = [_row(f"http://r{i}", mean, tokens=40, std=1.0) for i, mean in enumerate([0.0, 0.01, 0.05])]
    assert outliers(noisy) == []  # 0.05 apart, but 6 standard errors of 40 noisy tokens are far more
    assert outliers([*noisy[:2], _row("http://odd", 2.0, tokens=40, std=1.0)])[0].bound > DEPARTURE_FLOOR_NATS


def test_pooled_and_read_rows() -> None:
    rows = [_row("http://a", 0.1, tokens=100, std=0.0), _row("http://b", 0.3, tokens=300, std=0.0)]
    tokens, mean, std = pooled(rows)
    spread = (0.25 * 0.15 ** 2 + 0.75 * 0.05 ** 2) ** 0.5
    assert (tokens, round(mean, 6), round(std, 6)) == (400, 0.25, round(spread, 6))
    assert pooled([]) == (0, 0.0, 0.0)
    assert read_rows([rows[0].row(), {"replica": "x"}, "junk"]) == [rows[0]]
    assert read_rows(None) == []


def _lines(*windows: list[ReplicaRatio]) -> list[str]:
    return [json.dumps({"step": step, "ratio": 1.0, METRICS_KEY: [row.row() for row in rows]})
            for step, rows in enumerate(windows, start=1)]


def test_the_doctor_names_the_outlier_of_the_latest_window() -> None:
    healthy = [_row("http://a", 0.001), _row("http://b", -0.002), _row("http://c", 0.0)]
    bad = [*healthy[:2], _row("http://c", 0.4)]
    snapshot = Snapshot("http://proxy", metrics_path=Path("m.jsonl"), metrics_lines=_lines(healthy, bad))
    result = check_ratio(snapshot)
    assert result.status is Status.FAIL and "http://c on v3" in result.reason and "http://a" not in result.reason
    later = Snapshot("http://proxy", metrics_path=Path("m.jsonl"),
                     metrics_lines=[*_lines(bad), json.dumps({"step": 2, "ratio": 1.0})])
    assert check_ratio(later).status is Status.FAIL  # the latest window with rows decides
    fine = Snapshot("http://proxy", metrics_path=Path("m.jsonl"), metrics_lines=_lines(bad, healthy))
    assert check_ratio(fine).status is Status.PASS


def test_make_status_shows_each_replica_and_marks_the_outlier() -> None:
    rows = [_row("http://a:8000", 0.001), _row("http://b:8000", 0.0), _row("http://c:8000", -0.5)]
    metrics = [json.loads(line) for line in _lines(rows)] + [{"step": 2, "reward": 0.5}]
    text = "\n".join(render_ratio_by_replica(metrics))
    assert "ratio by replica (step 1; fleet ratio 1.0000" in text and "1200 tokens" in text
    marked = [line for line in text.splitlines() if "OUTLIER" in line]
    assert len(marked) == 1 and "http://c:8000" in marked[0] and "-0.50000" in marked[0]
    assert render_ratio_by_replica([{"step": 1, "ratio": 1.0}]) == []


def test_the_exporter_labels_replica_and_version_and_keeps_only_recent_versions(tmp_path: Path) -> None:
    metrics = TrainerMetrics(tmp_path)
    for version in range(1, REPLICA_VERSIONS_KEPT + 3):
        metrics.record({"ratio": 1.0, METRICS_KEY: [_row("http://a", 0.01 * version, version=version).row(),
                                                     _row("http://b", 0.0, version=version).row()]}, step=version)
    samples = [sample for family in metrics.registry.collect() if family.name == "lorafleet_trainer_replica_log_ratio"
               for sample in family.samples]
    versions = sorted({int(sample.labels["version"]) for sample in samples})
    assert versions == list(range(3, REPLICA_VERSIONS_KEPT + 3))
    newest = {sample.labels["replica"]: sample.value for sample in samples
              if sample.labels["version"] == str(REPLICA_VERSIONS_KEPT + 2)}
    assert newest == {"http://a": 0.01 * (REPLICA_VERSIONS_KEPT + 2), "http://b": 0.0}
