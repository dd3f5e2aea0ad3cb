"""The importance ratio per (replica, policy version): every trained token's log-ratio, log p_train - log p_replica,
counted for the replica that generated it, logged per window as metrics.jsonl's `ratio_by_replica`.

TRL's fleet-wide `ratio` dilutes one replica that decodes with other weights among the healthy ones. Here each loss
term is attributed: the loss's forward is observed (a forward hook for the length of `compute_loss`, TRL's or the
fast step's), the micro-batch's terms are grouped by sample (`segment_id`), and a sample is named by its replica
logprobs (provenance.logprob_key), the key its rollouts.jsonl line carries with the answers. That file is read as it
grows, so it also works when TRAINER_FAST_STEP's packing process reads TRL's queue. A sample whose turns came from
more than one (replica, version), or whose line is not found, is counted as unattributed. The host reads happen
once per logged window, not per micro-batch. Rank 0 only: with several ranks, its rows are a sample of the batch.
Story: docs/concepts/provenance.md.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lorafleet.adapters import policy_version
from lorafleet.ratio_outliers import METRICS_KEY, RatioWatch, ReplicaRatio
from lorafleet.runs import run_of
from transformers import TrainerCallback

from lorafleet_trainer import trl_seam
from lorafleet_trainer.fast_step.loss import FAST_KEY
from lorafleet_trainer.provenance import ROLLOUTS_FILE, logprob_key
from lorafleet_trainer.ratio_report import RatioReporter

UNATTRIBUTED_KEY = "ratio_by_replica/unattributed_tokens"
OUTLIERS_KEY = "ratio_by_replica/outliers"  # the window's outliers' evidence, logged only when there are some
CAPACITY = 1 << 16  # record lines remembered: far more than the samples read but not yet trained
Source = tuple[str, int]  # (replica URL, policy version)


def source_of(answers: list[dict[str, Any]]) -> Source | None:
    """The one (replica, version) that answered every turn, or None (several, or no proxy to say)."""
    named = {(answer.get("replica", ""), policy_version(run_of(answer.get("adapter", ""))[1])) for answer in answers}
    if len(named) != 1:
        return None
    replica, version = named.pop()
    return (replica, version) if replica and version is not None else None


class RolloutSources:
    """rollouts.jsonl read as it grows: each line's key -> the (replica, version) of its sample, taken once."""

    def __init__(self, path: Path, capacity: int = CAPACITY) -> None:
        self.path, self.capacity = path, capacity
        self._offset = 0
        self._sources: dict[str, deque[Source | None]] = {}
        self._order: deque[str] = deque()

    def take(self, key: str) -> Source | None:
        if key not in self._sources:
            self._read()
        waiting = self._sources.get(key)
        if not waiting:
            return None
        source = waiting.popleft()
        if not waiting:
            del self._sources[key]
        return source

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as lines:
                lines.seek(self._offset)
                data = lines.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
                key, source = str(record["key"]), source_of(record.get("answers") or [])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            self._sources.setdefault(key, deque()).append(source)
            self._order.append(key)
        while len(self._order) > self.capacity:  # read but never trained (dropped stale): forgotten, oldest first
            waiting = self._sources.get(self._order.popleft())
            if waiting:
                waiting.popleft()


@dataclass
class _Sums:
    tokens: int = 0
    total: float = 0.0
    absolute: float = 0.0
    square: float = 0.0
    ratio: float = 0.0

    def add(self, log_ratio: np.ndarray) -> None:
        self.tokens += log_ratio.size
        self.total += float(log_ratio.sum())
        self.absolute += float(np.abs(log_ratio).sum())
        self.square += float(np.square(log_ratio).sum())
        self.ratio += float(np.exp(log_ratio).sum())

    def row(self, source: Source) -> ReplicaRatio:
        mean = self.total / self.tokens
        return ReplicaRatio(replica=source[0], version=source[1], tokens=self.tokens, log_ratio_mean=mean,
                            abs_log_ratio_mean=self.absolute / self.tokens,
                            log_ratio_std=math.sqrt(max(self.square / self.tokens - mean * mean, 0.0)),
                            ratio_mean=self.ratio / self.tokens)


def loss_terms(inputs: dict[str, Any], log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-ratio, replica logprob, sample index) of each loss term, selected as the loss selects them: TRL's
    compute_loss over its collated batch, or the fast step's over a compact one (fast_step/loss.py)."""
    if FAST_KEY in inputs:
        return (log_probs[inputs["compact_index"]].detach() - inputs["old_log_probs"], inputs["old_log_probs"],
                inputs["segment_id"])
    selected = inputs["token_index"] >= 0
    old = inputs["old_log_probs"][selected]
    return log_probs.flatten()[inputs["token_index"][selected]].detach() - old, old, inputs["segment_id"][selected]


class ReplicaRatios(TrainerCallback):
    """Observes each loss's terms and adds the window's `ratio_by_replica` rows (and the unattributed token count) to
    the logged dict; a replica the run's sequential test (RatioWatch) names is logged and given to `reporter`
    (ratio_report.py).
    Put it before MetricsJsonl and the exporter among the callbacks; `bind` the built trainer."""

    def __init__(self, run_dir: Path, reporter: RatioReporter | None = None) -> None:
        self.sources = RolloutSources(run_dir / ROLLOUTS_FILE)
        self.reporter = reporter
        self.watch = RatioWatch()
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.bound = False

    def bind(self, trainer: Any) -> None:
        """Watch `trainer.compute_loss` (rank 0, which reads TRL's rollout queue, only)."""
        if getattr(trainer, "rollout_worker", None) is None:
            return
        trl_seam.wrap_compute_loss(trainer, self.watched)
        self.bound = True

    def watched(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        def observed(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            outputs: list[torch.Tensor] = []

            def keep(_module: Any, _args: Any, output: Any) -> None:
                if not outputs and getattr(output, "log_probs", None) is not None:
                    outputs.append(output.log_probs)

            handle = model.register_forward_hook(keep)
            try:
                loss = compute_loss(model, inputs, *args, **kwargs)
            finally:
                handle.remove()
            if outputs:
                self.pending.append(tuple(t.detach() for t in loss_terms(inputs, outputs[0])))  # type: ignore[arg-type]
            return loss

        return observed

    def drain(self) -> tuple[list[ReplicaRatio], int]:
        """The pending terms as rows per (replica, version), sorted, and the tokens no replica could be named for."""
        sums: dict[Source, _Sums] = {}
        unattributed = 0
        for log_ratio, old, segment in self.pending:
            ratios = log_ratio.float().cpu().numpy().astype(np.float64)
            replica_logprobs, segments = old.float().cpu().numpy(), segment.cpu().numpy()
            for index in np.unique(segments):
                terms = segments == index
                source = self.sources.take(logprob_key(replica_logprobs[terms]))
                if source is None:
                    unattributed += int(terms.sum())
                else:
                    sums.setdefault(source, _Sums()).add(ratios[terms])
        self.pending.clear()
        return [sums[source].row(source) for source in sorted(sums)], unattributed

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not self.bound or logs is None or "ratio" not in logs:  # a training window's log, on rank 0
            return
        rows, unattributed = self.drain()
        logs[METRICS_KEY] = [row.row() for row in rows]
        logs[UNATTRIBUTED_KEY] = unattributed
        found = self.watch.judge(rows)
        if found:
            logs[OUTLIERS_KEY] = [outlier.evidence() for outlier in found]
            if self.reporter is not None:
                self.reporter.report(found, max(row.version for row in rows))
