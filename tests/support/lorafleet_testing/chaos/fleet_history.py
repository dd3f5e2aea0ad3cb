"""Provenance against the fleet's history: every rollout the trainer read names a content the ledger held under that
adapter name, and a replica that held that name.

rollouts.jsonl (lorafleet_trainer.provenance) carries, per turn, the replica that answered (the URL the proxy knows it
by), the adapter name and the fingerprint the proxy's headers named, and when the trainer read it. observed.jsonl
(observe.py) holds every state of the ledger (watched every 50 ms) and, once a second, what each replica itself
lists on /v1/models, when it was asked and which process served it.

The ledger's side is exact: the fingerprint must be one the ledger held under that name. The replica's side is
judged where the listings can decide it. A replica answers only under a name it holds, so it must list the name at
some listing up to its first answered listing after the rollout was read. Two things can make that listing silent
without any fault of the product, and then the answer counts as unverified, not as a violation: the replica's
process changed before it (a restart loses what was loaded), or the name left the ledger before it (a retired
version is unloaded). A replica the observer never reached again is unverified too.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet_trainer.provenance import ROLLOUTS_FILE

Finding = tuple[str, Any]


@dataclass(frozen=True)
class Listing:
    """One look at a replica: when it was asked, the process serving it then, what it listed (None: no answer)."""

    at: float
    pid: int | None
    names: frozenset[str] | None


def is_sample(line: dict[str, Any]) -> bool:
    """A fleet sample (replicas listed), not a line of the ledger watch."""
    return "replicas" in line


def held(sample: dict[str, Any]) -> dict[str, list[str] | None]:
    """What each replica listed at a sample, ready or not (samples before `held` was recorded: the ready ones)."""
    return sample.get("held", sample["replicas"])


class FleetHistory:
    """What observed.jsonl shows: every fingerprint each name had in the ledger, when each name was in it, and each
    replica's listings in time order."""

    def __init__(self, observed: list[dict[str, Any]]) -> None:
        self.contents: dict[str, set[str]] = {}
        watch = [line for line in observed if not is_sample(line)] or observed  # older folders: the samples' ledgers
        watch = sorted(watch, key=lambda line: line["time"])
        self.ledger_times = [line["time"] for line in watch]
        self.ledgers = [set(line["ledger"]) for line in watch]
        for line in observed:
            for name, fingerprint in line["ledger"].items():
                self.contents.setdefault(name, set()).add(fingerprint)
        self.listings: dict[str, list[Listing]] = {}
        for sample in filter(is_sample, observed):
            for url, names in held(sample).items():
                at = sample.get("listed_at", {}).get(url, sample["time"])
                pid = sample.get("pids", {}).get(url)
                self.listings.setdefault(url, []).append(
                    Listing(at, pid, None if names is None else frozenset(names)))
        self.first_listed: dict[tuple[str, str], float] = {}  # when each replica first listed each name
        for url, listings in self.listings.items():
            listings.sort(key=lambda listing: listing.at)
            for listing in listings:
                for name in listing.names or ():
                    self.first_listed.setdefault((url, name), listing.at)

    def left_ledger(self, name: str, after: float, before: float) -> bool:
        """Whether some ledger state between `after` and `before` lacked `name`."""
        start = bisect.bisect_right(self.ledger_times, after)
        end = bisect.bisect_left(self.ledger_times, before)
        return any(name not in ledger for ledger in self.ledgers[max(start - 1, 0):end])

    def judge(self, answer: dict[str, Any], when: float) -> tuple[bool, str] | None:
        """None when one answer's provenance holds; else (violated, why): violated False when the listings cannot
        decide it."""
        name, fingerprint, replica = answer["adapter"], answer["fingerprint"], answer["replica"]
        if not replica or not name:
            return True, "an answer without provenance (no replica or adapter named)"
        if fingerprint not in (contents := self.contents.get(name, set())):
            return True, f"{name} never held {fingerprint} in the ledger (it held {sorted(contents)})"
        listings = self.listings.get(replica, [])
        first_after = bisect.bisect_right(listings, when, key=lambda listing: listing.at)
        after = next((listing for listing in listings[first_after:] if listing.names is not None), None)
        if self.first_listed.get((replica, name), float("inf")) <= (after.at if after else when):
            return None
        if after is None:
            return False, f"{replica} was not reached again after the rollout"
        # No look before it: the first look's process answered.
        serving = listings[first_after - 1].pid if first_after else after.pid
        if after.pid != serving or serving is None:
            return False, f"{replica} restarted before the observer's next look"
        if self.left_ledger(name, when, after.at):
            return False, f"{name} left the ledger before the observer's next look at {replica}"
        return True, f"{replica} was not seen holding {name} by its first listing after the rollout"


@dataclass
class ProvenanceTally:
    """Answers judged, and those the listings could not decide (with one example of why)."""

    answers: int = 0
    unverified: int = 0
    example: str = ""


def provenance_findings(folder: Path, history: FleetHistory, tally: ProvenanceTally | None = None) -> Iterator[Finding]:
    """Each rollout of the run folder's rollouts.jsonl whose provenance the fleet's history contradicts; `tally`
    counts the answers and the undecided ones."""
    tally = tally if tally is not None else ProvenanceTally()
    path = folder / ROLLOUTS_FILE
    for line in path.read_text().splitlines() if path.exists() else ():
        if not line.strip():
            continue
        rollout = json.loads(line)
        for answer in rollout.get("answers") or [{"replica": "", "adapter": "", "fingerprint": ""}]:
            tally.answers += 1
            verdict = history.judge(answer, rollout["time"])
            if verdict is None:
                continue
            violated, reason = verdict
            if violated:
                yield reason, rollout
            else:
                tally.unverified += 1
                tally.example = tally.example or reason
