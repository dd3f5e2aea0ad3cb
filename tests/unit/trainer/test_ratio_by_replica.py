"""The importance ratio per (replica, version) (issue 54, part 2), through TRL's own queue reader, planner and packer.

Samples as the rollout child sends them (ProvenancedSample) are read through the trainer's RolloutRecord by TRL's
RolloutQueueDataset, planned by its FixedCountBatcher and packed by its DataCollatorForRollout; a stand-in model scores
every position 0, so each term's log-ratio is minus the replica's logprob and the expected rows are known.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from collections import defaultdict
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from lorafleet.ports import free_port
from lorafleet.ratio_outliers import METRICS_KEY, Outlier, outliers, read_rows
from lorafleet_testing.stub_http import JsonStub
from lorafleet_trainer.fast_step.loss import compact_batch
from lorafleet_trainer.fleet_rollouts import ProvenancedSample
from lorafleet_trainer.provenance import ROLLOUTS_FILE, Answer, RolloutRecord
from lorafleet_trainer.proxy_client import ProxyClient
from lorafleet_trainer.ratio_by_replica import (
    OUTLIERS_KEY,
    UNATTRIBUTED_KEY,
    ReplicaRatios,
    RolloutSources,
    source_of,
)
from lorafleet_trainer.ratio_report import RatioReporter
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
)

PROMPT, COMPLETION = 4, 6
# Replica -> its logprob level: C decodes with other weights (its logprobs sit far from A's and B's).
LEVELS = {"http://a:8000": -0.10, "http://b:8000": -0.11, "http://c:8000": -0.70}


def _sample(index: int, replicas: tuple[str, ...], version: int = 3) -> ProvenancedSample:
    level = LEVELS[replicas[-1]]
    old = np.zeros(PROMPT + COMPLETION, np.float32)
    old[PROMPT:] = level - 0.001 * index - 0.0001 * np.arange(COMPLETION)  # every sample its own logprobs
    answers = tuple(Answer(replica, f"trl-policy-v{version}", "sha256:x", COMPLETION) for replica in replicas)
    return ProvenancedSample(
        prompt=[], completion=[], input_ids=np.array([1, 2, 3, 4, *(10 + index * 7 + np.arange(COMPLETION))]),
        completion_mask=np.array([0] * PROMPT + [1] * COMPLETION), old_log_probs=old, advantage=1.0,
        model_version=version, group_id=index // 4, metrics={}, answers=answers)


class _Scorer(torch.nn.Module):
    """The model's forward as TRL's loss calls it: every scored position gets log-probability 0."""

    def forward(self, input_ids: torch.Tensor, fused_label_index: torch.Tensor | None = None,
                **_: Any) -> SimpleNamespace:
        width = fused_label_index.numel() if fused_label_index is not None else input_ids.numel()
        return SimpleNamespace(log_probs=torch.zeros(1, width) if fused_label_index is None else torch.zeros(width))


def _loss(model: torch.nn.Module, inputs: dict[str, Any], *_: Any, **__: Any) -> torch.Tensor:
    model(input_ids=inputs["input_ids"], fused_label_index=inputs.get("label_index"))
    return torch.zeros(())


def _batch(tmp_path: Path, samples: list[ProvenancedSample]) -> dict[str, Any]:
    """The samples read through RolloutRecord by TRL's reader, planned and packed into one micro-batch."""
    fifo: queue.Queue = queue.Queue()
    for sample in samples:
        fifo.put(sample)
    reader = RolloutQueueDataset(RolloutRecord(fifo, tmp_path / ROLLOUTS_FILE), model_version_fn=lambda: 3,
                                 check_health_fn=lambda _: None, stale_after_s=60, metrics=defaultdict(list),
                                 max_staleness=4)
    rows = next(iter(FixedCountBatcher(reader, 1, len(samples))))
    return DataCollatorForRollout(pad_token_id=0)([rows])


def _expected(samples: list[ProvenancedSample]) -> dict[str, tuple[int, float]]:
    terms: dict[str, list[float]] = {}
    for sample in samples:
        terms.setdefault(sample.answers[-1].replica, []).extend(-sample.old_log_probs[PROMPT:].astype(np.float64))
    return {replica: (len(values), float(np.mean(values))) for replica, values in terms.items()}


@pytest.mark.parametrize("fast_step", [False, True], ids=["trl_loss", "fast_step"])
def test_each_replicas_tokens_are_counted_for_it_and_the_rows_add_up_to_the_fleet_ratio(tmp_path, fast_step):
    replicas = list(LEVELS)
    samples = [_sample(index, (replicas[index % 3],)) for index in range(18)]  # 36 tokens each
    batch = _batch(tmp_path, samples)
    ratios = ReplicaRatios(tmp_path)
    ratios.bind(SimpleNamespace(rollout_worker=object(), compute_loss=_loss))
    watched = ratios.watched(_loss)
    watched(_Scorer(), compact_batch(batch) if fast_step else batch)

    logs = {"ratio": 1.0}
    ratios.on_log(None, None, None, logs=logs)
    rows = read_rows(logs[METRICS_KEY])
    assert logs[UNATTRIBUTED_KEY] == 0
    assert {row.replica: (row.tokens, round(row.log_ratio_mean, 6)) for row in rows} == {
        replica: (tokens, round(mean, 6)) for replica, (tokens, mean) in _expected(samples).items()}
    assert all(row.version == 3 and row.abs_log_ratio_mean == pytest.approx(row.log_ratio_mean) for row in rows)
    assert all(0 < row.log_ratio_std < 0.01 for row in rows)
    # The fleet-wide mean TRL logs (exp of every term's log-ratio, averaged) is the rows' token-weighted mean.
    selected = batch["token_index"] >= 0
    fleet = float(torch.exp(-batch["old_log_probs"][selected].double()).mean())
    tokens = sum(row.tokens for row in rows)
    assert sum(row.tokens * row.ratio_mean for row in rows) / tokens == pytest.approx(fleet, abs=1e-9)
    assert [found.replica for found in outliers(rows)] == ["http://c:8000"]


def test_a_sample_from_two_replicas_or_unknown_is_counted_unattributed(tmp_path):
    samples = [_sample(0, ("http://a:8000", "http://c:8000")), _sample(1, ("http://b:8000",))]
    batch = _batch(tmp_path, samples)
    (tmp_path / ROLLOUTS_FILE).write_text((tmp_path / ROLLOUTS_FILE).read_text().splitlines()[0] + "\n")  # b unknown
    ratios = ReplicaRatios(tmp_path)
    ratios.bind(SimpleNamespace(rollout_worker=object(), compute_loss=_loss))
    ratios.watched(_loss)(_Scorer(), batch)
    rows, unattributed = ratios.drain()
    assert rows == [] and unattributed == 2 * COMPLETION


def test_a_rank_without_the_rollout_queue_logs_no_rows(tmp_path):
    ratios = ReplicaRatios(tmp_path)
    trainer = SimpleNamespace(rollout_worker=None, compute_loss=_loss)
    ratios.bind(trainer)
    logs = {"ratio": 1.0}
    ratios.on_log(None, None, None, logs=logs)
    assert trainer.compute_loss is _loss and logs == {"ratio": 1.0}


def _line(key: str, *answers: tuple[str, str]) -> str:
    return json.dumps({"key": key, "answers": [{"replica": r, "adapter": a} for r, a in answers]}) + "\n"


def test_rollout_sources_follow_the_file_as_it_grows_and_give_each_line_once(tmp_path):
    path = tmp_path / ROLLOUTS_FILE
    sources = RolloutSources(path, capacity=3)
    assert sources.take("k1") is None  # no file yet
    path.write_text(_line("k1", ("http://a", "trl-policy-v2")) + _line("k1", ("http://b", "run--trl-policy-v2"))
                    + '{"key": "k2", "answ')  # a line still being written
    assert sources.take("k1") == ("http://a", 2)
    assert sources.take("k1") == ("http://b", 2)  # a named run's fleet name
    assert sources.take("k1") is None and sources.take("k2") is None
    with open(path, "a") as out:
        out.write('ers": [{"replica": "http://c", "adapter": "trl-policy-v5"}]}\n')
        out.write("not json\n" + _line("k3", ("http://c", "base-model")) + _line("k4") + _line("k5") + _line("k6"))
    assert sources.take("k2") is None  # forgotten: beyond the capacity, oldest first
    assert sources.take("k6") is None  # known, but no answer names a replica


@pytest.mark.parametrize(("answers", "source"), [
    ([], None),
    ([{"replica": "http://a", "adapter": "trl-policy-v1"}], ("http://a", 1)),
    ([{"replica": "http://a", "adapter": "trl-policy-v1"}] * 2, ("http://a", 1)),
    ([{"replica": "http://a", "adapter": "trl-policy-v1"}, {"replica": "http://a", "adapter": "trl-policy-v2"}], None),
    ([{"replica": "", "adapter": "trl-policy-v1"}], None),
    ([{"replica": "http://a", "adapter": "tiny"}], None),
])
def test_a_sample_has_one_source_only_when_every_turn_names_the_same_replica_and_version(answers, source):
    assert source_of(answers) == source


def test_rows_survive_metrics_jsonl(tmp_path):
    samples = [_sample(index, (list(LEVELS)[index % 3],)) for index in range(6)]
    batch = _batch(tmp_path, samples)
    ratios = ReplicaRatios(tmp_path)
    ratios.bind(SimpleNamespace(rollout_worker=object(), compute_loss=_loss))
    ratios.watched(_loss)(_Scorer(), batch)
    logs = {"ratio": 1.0}
    ratios.on_log(None, None, None, logs=logs)
    again = read_rows(json.loads(json.dumps(logs))[METRICS_KEY])
    assert again == read_rows(logs[METRICS_KEY]) and all(math.isfinite(row.ratio_mean) for row in again)


class _Proxy(JsonStub):
    """Answers /ratio_report as the proxy does, keeping each body and its Authorization header."""

    reports: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = self.json_body()
        type(self).reports.append((self.headers.get("Authorization", ""), {"path": self.path, **body}))
        self.answer({"replica": body["replica"], "lora_name": body["lora_name"], "outcome": "quarantined"})


def test_an_outlier_is_logged_and_reported_to_the_proxy_once_per_replica_and_version(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Proxy.reports = []
    reporter = RatioReporter(ProxyClient(f"http://127.0.0.1:{server.server_port}/runs/r", "lfr_key"))
    samples = [_sample(index, (list(LEVELS)[index % 3],)) for index in range(18)]
    batch = _batch(tmp_path, samples)
    ratios = ReplicaRatios(tmp_path, reporter)
    ratios.bind(SimpleNamespace(rollout_worker=object(), compute_loss=_loss))
    try:
        for _ in range(2):  # two windows that find the same outlier: one report
            ratios.watched(_loss)(_Scorer(), batch)
            (tmp_path / ROLLOUTS_FILE).write_text((tmp_path / ROLLOUTS_FILE).read_text() * 2)  # the samples again
            logs = {"ratio": 1.0}
            ratios.on_log(None, None, None, logs=logs)
            assert [e.split(" on ")[0] for e in logs[OUTLIERS_KEY]] == ["http://c:8000"]
        for thread in reporter.threads:
            thread.join(timeout=10)
    finally:
        server.shutdown()
    assert len(_Proxy.reports) == 1
    authorization, body = _Proxy.reports[0]
    assert authorization == "Bearer lfr_key" and body["path"] == "/runs/r/ratio_report"
    assert body["replica"] == "http://c:8000" and body["lora_name"] == "trl-policy-v3"
    assert "mean |log-ratio|" in body["evidence"]


def test_a_proxy_that_cannot_be_reached_is_logged_and_training_goes_on(caplog):
    reporter = RatioReporter(ProxyClient(f"http://127.0.0.1:{free_port()}"))
    reporter.report([Outlier("http://c", 3, 0.5, 0.02, 64, 128)], newest=7)
    for thread in reporter.threads:
        thread.join(timeout=30)
    assert "ratio_report_failed" in caplog.text
    # Named on evidence from v3, reported under the window's newest version: v3 may be unloaded by now.
    outlier = next(record for record in caplog.records if record.getMessage() == "ratio_outlier")
    assert outlier.fields["adapter"] == "trl-policy-v7" and reporter.reported == {("http://c", 7)}
