"""`lorafleet status` and the demo's report: numbers come from the run's metrics and the fleet, none invented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lorafleet_ops.commands import demo
from lorafleet_ops.commands.demo import (
    build_report,
    run_names,
    shared_report,
    summary,
    sync_lines,
    sync_report,
    trainer_url,
)
from lorafleet_ops.commands.status import adapter_span, read_metrics, render_status

FLEET = {
    "replicas": [
        {"url": "http://127.0.0.1:9001", "state": "ready", "inflight": 3, "routed": 120,
         "adapters": {f"trl-policy-v{v}": f"/a/trl-policy-v{v}" for v in range(3, 8)}, "last_error": None},
        {"url": "http://127.0.0.1:9002", "state": "ejected", "inflight": 0, "routed": 40, "adapters": {},
         "last_error": "health check failed"},
    ],
    "ledger": [{"name": f"trl-policy-v{v}", "path": f"/a/trl-policy-v{v}"} for v in range(3, 8)],
    "router": {"mode": "affinity", "block_size": 128, "routed": 160, "affinity": 136, "spilled": 4, "unmatched": 20,
               "tracked_blocks": 77},
    "min_ready": 1,
}


def _metrics(rewards: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward": r, "ratio": 1.0 + (i % 3 - 1) * 0.002, "perf/weight_sync_s": 0.1 * (i + 1)}
            for i, r in enumerate(rewards)]


def test_adapter_span_compacts_policy_versions():
    assert adapter_span(["trl-policy-v9", "trl-policy-v5", "trl-policy-v7"]) == "trl-policy-v5 … v9 (3)"
    assert adapter_span(["probe"]) == "probe (1)"
    assert adapter_span([]) == "-"
    shared = ["b--trl-policy-v6", "a--trl-policy-v3", "trl-policy-v2", "a--trl-policy-v4", "b--trl-policy-v5"]
    assert adapter_span(shared) == "trl-policy-v2, a--trl-policy-v3 … v4, b--trl-policy-v5 … v6 (5)"


def test_status_shows_states_errors_routing_shares_and_latest_training_values():
    text = render_status(FLEET, "http://proxy:8000", _metrics([0.1, 0.2, 0.3]))
    assert "ready 1/2 (min 1)" in text and "block 128 tokens" in text
    assert "ejected" in text and "last error: health check failed" in text
    assert "affinity 85.0%" in text and "spilled 2.5%" in text and "unmatched 12.5%" in text
    assert "step 3" in text and "reward 0.300" in text
    assert "training: no metrics logged yet" in render_status(FLEET, "u", [])
    assert "runs:" not in render_status(FLEET, "u", [])  # a single-run fleet shows no runs table


def test_status_lists_the_runs_sharing_the_fleet_with_slots_tokens_shares_pauses_and_leases():
    runs = [{"run": run, "slots": 6, "weight": weight, "inflight": 4, "generated_tokens": tokens, "share": share,
             "paused": paused, "lease_left_s": lease, "adapters": [f"trl-policy-v{v}" for v in range(2, 7)]}
            for run, weight, tokens, share, paused, lease in [("a", 1.0, 3000, 0.75, None, 880.0),
                                                              ("b", 2.0, 1000, 0.25, "wait", 12.0)]]
    fleet = {**FLEET, "runs": runs, "slots": {"capacity": 12, "reserved": 12, "unreclaimed": ["a--trl-policy-v1"]}}
    text = render_status(fleet, "u", [])
    assert "runs: slot budget 12 (--max-loras), reserved 12, unreclaimed 1" in text
    row_a = next(line for line in text.splitlines() if line.startswith("a "))
    assert "75.0%" in row_a and "880s" in row_a and "trl-policy-v2 … v6 (5)" in row_a and " 3000 " in row_a
    row_b = next(line for line in text.splitlines() if line.startswith("b "))
    assert "wait" in row_b and "25.0%" in row_b and " 2 " in row_b


def test_partial_metrics_lines_are_skipped(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n" + '{"step": 2, "rew')
    assert read_metrics(path) == [{"step": 1, "reward": 0.5}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_report_is_computed_from_the_run():
    metrics = _metrics([0.0, 0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.6])
    cache = {"replicas": {}, "hit_rate": 0.5}
    report = build_report(metrics, FLEET, cache, wall_s=42.0)
    assert report["steps"] == 9
    assert report["reward"]["window_steps"] == 3
    assert report["reward"]["first_steps_mean"] == (0.0 + 0.1 + 0.1) / 3
    assert report["reward"]["last_steps_mean"] == (0.5 + 0.5 + 0.6) / 3
    assert report["importance_ratio"] == {"min": 0.998, "max": 1.002}
    assert report["weight_sync_s"]["p50"] == 0.5 and report["weight_sync_s"]["count"] == 9
    assert report["adapters"]["loaded_on"]["http://127.0.0.1:9002"] == []
    text = summary(report)
    assert "first 3 steps 0.067 -> last 3 steps 0.533" in text
    assert "prefix cache hit rate (replicas' /metrics): 50.0%" in text


def test_several_runs_report_each_runs_training_and_its_share_from_the_proxys_counts():
    fleet = {**FLEET, "runs": [{"run": "a", "weight": 1.0, "generated_tokens": 3000, "share": 0.6},
                               {"run": "b", "weight": 1.0, "generated_tokens": 2000, "share": 0.4}]}
    metrics = {"a": _metrics([0.0, 0.1, 0.2, 0.4, 0.5, 0.6]), "b": _metrics([0.1, 0.1, 0.1, 0.3, 0.3, 0.3])}
    report = shared_report(metrics, fleet, {"replicas": {}, "hit_rate": 0.5}, wall_s=42.0)
    assert set(report["runs"]) == {"a", "b"} and "reward" not in report  # training numbers live per run
    assert report["runs"]["a"]["reward"]["first_steps_mean"] == pytest.approx(0.05)
    assert report["runs"]["b"]["reward"]["last_steps_mean"] == pytest.approx(0.3)
    assert report["runs"]["a"]["token_share"] == 0.6 and report["runs"]["b"]["generated_tokens"] == 2000
    text = summary(report)
    assert "2 runs sharing the fleet" in text and "run b: steps 6, weight 1, 2000 tokens generated, share 40.0%" in text
    assert "  reward: first 2 steps 0.100 -> last 2 steps 0.300" in text


def test_demo_runs_are_the_default_run_alone_or_named_runs_under_their_prefix():
    assert run_names(1) == ["demo"] and trainer_url("http://p:1", "demo", 1) == "http://p:1"
    assert run_names(3) == ["a", "b", "c"] and trainer_url("http://p:1", "b", 3) == "http://p:1/runs/b"
    with pytest.raises(ValueError, match="--runs"):
        run_names(0)


@pytest.mark.parametrize(("failed", "code"), [([], 0), (["broadcasts", "ratio"], 1)])
def test_demo_exits_non_zero_and_loudly_on_a_doctor_fail(monkeypatch, capsys, tmp_path, failed, code):
    report = build_report(_metrics([0.1, 0.2, 0.3]), FLEET, {"replicas": {}, "hit_rate": None}, wall_s=1.0)
    report.update(doctor="(the doctor's table)", doctor_failed=failed)
    monkeypatch.setattr(demo, "run_demo", lambda options: report)
    assert demo.main(demo.DemoOptions(out=tmp_path)) == code
    err = capsys.readouterr().err
    assert ("lorafleet demo FAILED" in err and "broadcasts, ratio" in err) if failed else err == ""
def _proxy_metrics() -> str:
    """The proxy's real /metrics text after 7 elided syncs, one 20 ms broadcast pause and 11 loads of 50 ms."""
    from lorafleet_proxy.metrics import Metrics
    from prometheus_client import generate_latest

    metrics = Metrics()
    metrics.pauses_elided.inc(7)
    metrics.pause_seconds.observe(0.02)
    for _ in range(11):
        metrics.broadcast_seconds.labels("load").observe(0.05)
    metrics.broadcast_seconds.labels("pause").observe(9.0)
    return generate_latest(metrics.registry).decode()


def test_sync_report_bounds_the_stall_by_paused_time_plus_elided_loads():
    metrics = [{"step": s, "time": 1000.0 + 3 * s, "reward": 0.1} for s in range(1, 11)]
    sync = sync_report(_proxy_metrics(), {**FLEET, "sync_pause": "elide"}, 6000.0, metrics, trainer_s=60.0)
    assert sync["syncs"] == 7  # the newest version in the ledger: TRL numbers syncs from v1
    assert sync["paused_per_sync_s"] == 0.02 / 7
    assert sync["load_per_sync_s"] == pytest.approx(0.05)
    assert sync["stall_per_sync_s"] == pytest.approx(0.02 / 7 + 0.05)  # all elided: each may stall for its load
    assert sync["generated_tokens_per_s"] == 100.0 and sync["steps_per_minute"] == 20.0
    assert "7 of 7 pauses elided" in "\n".join(sync_lines(sync))


def test_the_report_has_each_eval_pass_with_how_often_each_reward_scored_and_plots_it(tmp_path):
    metrics = _metrics([0.1, 0.2, 0.3, 0.4])
    metrics[0].update({"eval/pass_at_1": 0.25, "eval/step": 1.0, "eval/model_version": 1.0, "eval/reward": 0.3,
                       "eval/nonzero/correct": 0.25, "eval/nonzero/bare_number": 0.1})
    metrics[3].update({"eval/pass_at_1": 0.5, "eval/step": 4.0, "eval/model_version": 4.0, "eval/reward": 0.8,
                       "eval/nonzero/correct": 0.5, "eval/nonzero/bare_number": 0.6})
    report = build_report(metrics, FLEET, {"replicas": {}, "hit_rate": None}, wall_s=1.0)
    assert [(row["step"], row["pass_at_1"], row["nonzero"]["bare_number"]) for row in report["eval"]] == [
        (1, 0.25, 0.1), (4, 0.5, 0.6)]
    assert report["eval_pass_at_1"] == {"first": 0.25, "last": 0.5, "best": 0.5, "change_points": 25.0}
    text = summary(report)
    assert "eval pass@1 by step: 1: 0.25, 4: 0.50" in text and "eval bare_number > 0 by step: 1: 0.10, 4: 0.60" in text
    demo.plot_report({"demo": metrics}, tmp_path / "report.png", title="task arithmetic")
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_status_shows_each_replicas_attestation() -> None:
    replicas = [{**FLEET["replicas"][0], "attestation": {"state": "unattested", "failure": "cannot attest: 404"}},
                {**FLEET["replicas"][1], "attestation": {"state": "attested", "adapters": 3, "age_s": 4.0}}]
    text = render_status({**FLEET, "replicas": replicas}, "u", [])
    assert "unattested: cannot attest: 404" in text
    assert "attested 3 adapter(s) 4.0s ago" in text
