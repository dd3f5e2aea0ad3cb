"""The ratio per replica as its readers see it (issues 54 and 66): which replica decodes with other weights
(lorafleet.ratio_outliers: a sequential test on its divergence against each peer's), `make status`'s table, the
doctor's ratio check and the exporter's labelled gauges, all from metrics.jsonl's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.ratio_outliers import (
    DIVERGENCE_SHIFT_NATS,
    EVIDENCE_THRESHOLD,
    METRICS_KEY,
    MIN_TOKENS,
    TOKEN_SD_FLOOR_NATS,
    RatioWatch,
    ReplicaRatio,
    divergence_variance,
    outliers,
    pooled,
    read_rows,
    steps,
    tokens_to_name,
)
from lorafleet_ops.commands.doctor.fleet_checks import check_ratio
from lorafleet_ops.commands.doctor.model import Snapshot, Status
from lorafleet_ops.commands.status import render_ratio_by_replica
from lorafleet_trainer.exporter import REPLICA_VERSIONS_KEPT, TrainerMetrics

pytestmark = pytest.mark.timeout(120)


def _row(replica: str, mean: float, version: int = 3, tokens: int = 400, std: float = 0.01) -> ReplicaRatio:
    return ReplicaRatio(replica=replica, version=version, tokens=tokens, log_ratio_mean=mean,
                        abs_log_ratio_mean=abs(mean) + std, log_ratio_std=std, ratio_mean=1.0 + mean)


def _diverging(replica: str, divergence: float, tokens: int, version: int = 3) -> ReplicaRatio:
    """Tokens sampled from another policy: log-ratios of both signs (signed mean ~0), spread TOKEN_SD_FLOOR_NATS
    around their mean |log-ratio| `divergence`."""
    spread = TOKEN_SD_FLOOR_NATS
    return ReplicaRatio(replica=replica, version=version, tokens=tokens, log_ratio_mean=0.0,
                        abs_log_ratio_mean=divergence, log_ratio_std=(divergence ** 2 + spread ** 2) ** 0.5,
                        ratio_mean=1.0)


shift = DIVERGENCE_SHIFT_NATS
tokens_per_window = st.integers(MIN_TOKENS, 300)
levels = st.floats(0.0, 0.5)  # the divergence healthy replicas share in a window (staleness moves it)


@given(st.lists(st.tuples(levels, st.lists(st.tuples(st.floats(0.0, shift / 2), tokens_per_window), min_size=2,
                                           max_size=6)), min_size=1, max_size=40))
def test_replicas_never_more_than_half_the_shift_apart_are_never_named(windows) -> None:
    """Each window's step adds at most 0 evidence when a replica exceeds a peer by no more than the allowance."""
    watch = RatioWatch()
    for level, replicas in windows:
        rows = [_diverging(f"http://r{i}", level + excess, tokens) for i, (excess, tokens) in enumerate(replicas)]
        assert watch.judge(rows) == []


@given(st.integers(1, 5), st.integers(0, 2), st.floats(shift, 1.0), levels,
       st.lists(st.tuples(tokens_per_window, st.integers(0, 300)), min_size=1, max_size=400))
def test_a_replica_that_diverges_more_is_named_within_the_tokens_the_bound_states(
        healthy: int, faulty_others: int, excess: float, level: float, windows: list[tuple[int, int]]) -> None:
    """However few tokens per window, and however many other faulty replicas (one healthy peer suffices): the
    replica is named once it has about tokens_to_name(excess) tokens (plus its last window), healthy ones never."""
    watch, named, tokens, last = RatioWatch(), {}, 0, 0
    bound = tokens_to_name(excess)
    for own, extra in windows:
        rows = [_diverging(f"http://healthy{i}", level, own + extra) for i in range(healthy)]
        rows += [_diverging(f"http://odd{i}", level + excess, own + extra) for i in range(faulty_others)]
        rows.append(_diverging("http://odd", level + excess, own))
        tokens, last = tokens + own, own
        named.update({found.replica: found for found in watch.judge(rows)})
        if "http://odd" in named:
            break
    assert not [replica for replica in named if replica.startswith("http://healthy")]
    if tokens > bound:  # named once past the bound
        found = named["http://odd"]
        assert found.tokens == tokens <= bound + last  # the bound, overshot by its last window at most
        assert found.departure == pytest.approx(excess) and found.bound == EVIDENCE_THRESHOLD


def test_two_replicas_one_peer_each_the_farther_one_is_named() -> None:
    rows = [_diverging("http://a", 0.05, 64), _diverging("http://b", 0.2, 64)]
    watch = RatioWatch()
    named = [found for _ in range(20) for found in watch.judge(rows)]
    assert named and {found.replica for found in named} == {"http://b"}
    assert "http://b on v3: mean |log-ratio| +0.1500 nats above its peers'" in named[0].evidence()


def test_a_signed_mean_near_zero_does_not_hide_a_wide_divergence() -> None:
    """Issue 66's run: the base model's tokens had mean log-ratio -0.024 against the healthy -0.002, but mean
    |log-ratio| 0.196 against 0.047: judged by divergence, it is named within its 1,527 tokens."""
    healthy = ReplicaRatio("http://healthy", 3, 40, -0.002, 0.047, 0.07, 1.0)
    base = ReplicaRatio("http://base", 3, 40, -0.024, 0.196, 0.3, 1.0)
    watch, tokens = RatioWatch(), 0
    while not watch.judge([healthy, base]):
        tokens += base.tokens
    assert tokens + base.tokens <= 1527


def test_versions_are_judged_apart_and_small_or_lone_samples_not_at_all() -> None:
    rows = [_diverging("http://a", 0.0, 400, version=2), _diverging("http://c", 0.9, 400, version=4),  # alone
            _diverging("http://a", 0.0, 400), _diverging("http://b", 0.5, 400),
            _diverging("http://c", 3.0, MIN_TOKENS - 1)]  # too few tokens to count
    assert [(found.replica, found.version) for found in outliers(rows)] == [("http://b", 3)]
    assert {(step.row.replica, step.peer.replica) for step in steps(rows)} == {("http://a", "http://b"),
                                                                              ("http://b", "http://a")}


def test_evidence_builds_over_windows_and_a_quiet_spell_clears_it() -> None:
    few = [_diverging("http://a", 0.05, MIN_TOKENS), _diverging("http://b", 0.15, MIN_TOKENS)]
    watch = RatioWatch()
    assert watch.judge(few) == [] and watch.evidence[("http://b", "http://a")].score > 0
    watch.judge([_diverging("http://a", 0.05, 400), _diverging("http://b", 0.05, 400)])
    assert ("http://b", "http://a") not in watch.evidence  # as much as its peer: the evidence is back to 0
    windows = 1
    while not watch.judge(few):
        windows += 1
    assert windows > 1 and windows * MIN_TOKENS <= tokens_to_name(0.1) + MIN_TOKENS


def test_the_spread_of_abs_log_ratio_comes_from_the_rows_and_is_floored() -> None:
    wide = ReplicaRatio("http://a", 1, 100, 0.0, 0.4, 0.5, 1.0)
    assert divergence_variance(wide) == pytest.approx(0.25 - 0.16)
    assert divergence_variance(_row("http://a", 0.0, std=0.0)) == TOKEN_SD_FLOOR_NATS ** 2
    assert tokens_to_name(shift / 2) == 0 and tokens_to_name(0.2) < tokens_to_name(0.1)


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
