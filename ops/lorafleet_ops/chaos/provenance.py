"""Provenance against the fleet's history: every rollout the trainer read names a content the ledger held under that
adapter name, and a replica the observer saw holding that name.

rollouts.jsonl (lorafleet_trainer.provenance) carries, per turn, the replica that answered (the URL the proxy knows it
by), the adapter name and the fingerprint the proxy's headers named. observed.jsonl (observe.py) samples the ledger and
what each replica itself lists on /v1/models once a second. The observer cannot see a load and a generation that both
fall between two of its samples, so a replica counts as having held the name when it listed it at some sample up to
the first one after the rollout was logged: a replica that never listed the name before that (it never loaded it, or
a restart lost it and nothing reloaded it) fails. Samples read all rollouts, trained or dropped as stale.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorafleet_trainer.provenance import ROLLOUTS_FILE

Finding = tuple[str, Any]


class FleetHistory:
    """What the samples show: every fingerprint each name had in the ledger, and when each replica first listed it."""

    def __init__(self, observed: list[dict[str, Any]]) -> None:
        self.times = [sample["time"] for sample in observed]
        self.contents: dict[str, set[str]] = {}
        self.first_held: dict[tuple[str, str], float] = {}
        for sample in observed:
            for name, fingerprint in sample["ledger"].items():
                self.contents.setdefault(name, set()).add(fingerprint)
            for url, names in held(sample).items():
                for name in names or ():
                    self.first_held.setdefault((url, name), sample["time"])

    def seen_by(self, when: float) -> float:
        """The time of the first sample after `when` (the last sample's when none is later)."""
        index = bisect.bisect_right(self.times, when)
        return self.times[min(index, len(self.times) - 1)] if self.times else float("-inf")

    def judge(self, answer: dict[str, Any], when: float) -> str | None:
        """Why one answer's provenance is false (None when it holds)."""
        name, fingerprint, replica = answer["adapter"], answer["fingerprint"], answer["replica"]
        if not replica or not name:
            return "an answer without provenance (no replica or adapter named)"
        if fingerprint not in self.contents.get(name, ()):
            return f"{name} never held {fingerprint} in the ledger (it held {sorted(self.contents.get(name, ()))})"
        first = self.first_held.get((replica, name))
        if first is None or first > self.seen_by(when):
            return f"{replica} was not seen holding {name} by the first sample after the rollout"
        return None


def held(sample: dict[str, Any]) -> dict[str, list[str] | None]:
    """What each replica listed at a sample, ready or not (samples before `held` was recorded: the ready ones)."""
    return sample.get("held", sample["replicas"])


def provenance_findings(folder: Path, history: FleetHistory) -> Iterator[Finding]:
    """Each rollout of the run folder's rollouts.jsonl whose provenance the fleet's history contradicts."""
    path = folder / ROLLOUTS_FILE
    for line in path.read_text().splitlines() if path.exists() else ():
        if not line.strip():
            continue
        rollout = json.loads(line)
        for answer in rollout.get("answers") or [{"replica": "", "adapter": "", "fingerprint": ""}]:
            if (reason := history.judge(answer, rollout["time"])) is not None:
                yield reason, rollout
