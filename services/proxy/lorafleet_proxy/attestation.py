"""Attestation: every replica says, from inside its engine, which LoRA weights it holds under each name, and the proxy
holds it to the ledger.

The replica's worker extension (lorafleet_vllm.lora_identity) answers `POST /collective_rpc` with its report
(lorafleet.engine_identity): per adapter the digest of its registered weights, the digest of its slot's stacked
tensors and the projections it applies against those its files name. The proxy asks after every load (broadcast.py
`attest_load`), at the end of every catch-up (admission and re-sync, `check`) and every PROXY_ATTEST_INTERVAL_S
(`round`). The first replica of a group (vLLM version and dtype) to attest a content sets that content's reference in
the ledger entry; afterwards a replica whose digest differs, whose engine applies fewer projections than the files
name (0 included), or that lists a name the ledger does not hold, disagrees: out of routing and re-synced with that
adapter reloaded (fleet.distrust), ready again only once it attests correctly. A replica that cannot attest (a vLLM
without dev mode or without the extension) is "unattested": it serves, and /fleet, `make status` and the doctor say
so. Why and what each layer catches: docs/concepts/provenance.md#attestation-what-the-engine-holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

from lorafleet.engine_identity import AdapterIdentity, Report, ReportError, attest_request, parse_report
from lorafleet.ledger_format import Entry
from lorafleet.vllm_api import VLLMError, VLLMUnreachable

from .epoch import Broadcasts, unchanged_since
from .metrics import Metrics
from .replica_state import Attestation as Seen
from .replica_state import Replica


class AttestedFleet(Broadcasts, Protocol):
    """What attestation needs of the fleet (fleet.Fleet is one): the ready replicas, the ledger's entries, to record
    references, and to distrust a replica."""

    def ready(self) -> list[Replica]: ...

    def wanted(self) -> dict[str, Entry]: ...

    def record_references(self, entries: dict[str, Entry]) -> Exception | None: ...

    def distrust(self, replica: Replica, subjects: list[str], reason: str) -> None: ...

log = logging.getLogger("lorafleet.proxy.attestation")

RPC_TIMEOUT_S = 30.0


class AttestationDisagreement(VLLMError):
    """A syncing replica's engine holds other weights than the ledger's reference: it stays out of routing."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, "AttestationDisagreement")
        self.args = (message,)


@dataclass(frozen=True)
class Verdict:
    """One replica's report against the ledger: what is wrong (empty: it attests), references it set."""

    problems: dict[str, str]  # adapter name ("" for the replica as a whole) -> why
    references: dict[str, Entry]  # entries that gained a reference from this report


def compare(name: str, entry: Entry, group: str, held: AdapterIdentity) -> tuple[str | None, Entry]:
    """One adapter's identity against its ledger entry: (why it disagrees or None, the entry with any reference this
    identity sets)."""
    if held.path != entry.path:
        return f"{name} registered from {held.path!r}, not the ledger's {entry.path!r}", entry
    if held.shortfall:
        return (f"{name}: the engine applies {len(set(held.applied))} of the {len(held.named or ())} projections its "
                f"files name"), entry
    reference = entry.reference(group)
    if reference is None:
        return None, replace(entry, attested=(*entry.attested, (group, held.weights, held.slot_weights or "")))
    weights, slot = reference
    if held.weights != weights:
        return f"{name}: registered weights {held.weights[:19]} differ from the reference {weights[:19]}", entry
    if held.slot_weights is None:
        return None, entry
    if not slot:
        others = tuple(item for item in entry.attested if item[0] != group)
        return None, replace(entry, attested=(*others, (group, weights, held.slot_weights)))
    if held.slot_weights != slot:
        return f"{name}: its LoRA slot holds {held.slot_weights[:19]}, not the reference {slot[:19]}", entry
    return None, entry


def judge(report: Report, listed: dict[str, str], wanted: dict[str, Entry]) -> Verdict:
    """A replica's report and the names its API server lists, against the ledger's entries. An adapter the engine
    does not hold now (evicted from vLLM's CPU cache; it is read from its files again at its next request) is not
    judged."""
    problems: dict[str, str] = {}
    references: dict[str, Entry] = {}
    for name in listed:
        if name not in wanted:
            problems[name] = f"serves {name}, which the ledger does not hold"
    for name, entry in wanted.items():
        held = report.adapters.get(name)
        if held is None or name not in listed:
            continue
        why, updated = compare(name, entry, report.group, held)
        if why is not None:
            problems[name] = why
        elif updated != entry:
            references[name] = updated
    return Verdict(problems, references)


class AttestationWatch:
    """Asks replicas for their reports and acts on the verdicts."""

    def __init__(self, fleet: AttestedFleet, metrics: Metrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.rounds = 0

    async def read(self, replica: Replica, names: list[str] | None = None) -> Report | None:
        """The replica's report (of `names` only, when given), or None: unreachable (the health loop's to judge) or
        unable to attest (marked)."""
        body = {**attest_request(names), "timeout": RPC_TIMEOUT_S}
        try:
            answer = await replica.client.request("POST", "/collective_rpc", json_body=body, timeout=RPC_TIMEOUT_S)
            return parse_report(answer.json())
        except VLLMUnreachable:
            return None
        except (VLLMError, ReportError, ValueError) as exc:
            self.unattested(replica, f"cannot attest: {exc}")
            return None

    def unattested(self, replica: Replica, why: str) -> None:
        if replica.attestation.state != "unattested":
            log.warning("replica unattested url=%s: %s", replica.url, why)
        replica.attestation = Seen("unattested", why[:300], {}, time.monotonic(), replica.attestation.trusted_at)

    def accept(self, replica: Replica, report: Report, verdict: Verdict, *, partial: bool = False) -> None:
        """Note what a report showed on the replica: the digest per adapter it holds and when (provenance). A `partial`
        report (a load's: its adapter only) adds its digests to the last full report's and keeps that report's time, so
        the age shown is never younger than the digest it stands for."""
        digests = {name: held.weights for name, held in report.adapters.items() if name not in verdict.problems}
        failure = "; ".join(verdict.problems.values()) or None
        trusted = replica.attestation.trusted_at if failure else time.time()
        seen, at = replica.attestation, time.monotonic()
        if partial:
            digests = {**seen.digests, **digests}
            at = seen.at if seen.at is not None else at
        replica.attestation = Seen("disagrees" if failure else "attested", failure, digests, at, trusted)
        self.metrics.attestations.labels("disagrees" if failure else "attested").inc()
        if failure:
            log.error("replica attestation disagrees url=%s (answers since %s are flagged): %s", replica.url,
                      trusted, failure)

    def verdict(self, replica: Replica, report: Report, listed: dict[str, str]) -> Verdict:
        """Judge a report (and the names the replica listed) against the ledger; references it sets are recorded."""
        verdict = judge(report, listed, self.fleet.wanted())
        self.fleet.record_references(verdict.references)
        self.accept(replica, report, verdict)
        return verdict

    async def check(self, replica: Replica) -> None:
        """The end of a catch-up: the replica attests the ledger, or stays out (raises AttestationDisagreement). A
        replica that cannot attest goes on, shown unattested."""
        report = await self.read(replica)
        if report is None:
            return
        verdict = self.verdict(replica, report, await replica.client.loaded_adapters())
        if verdict.problems:
            self.metrics.attestation_disagreements.inc()
            replica.suspect.update(name for name in verdict.problems if name)
            raise AttestationDisagreement("attestation: " + "; ".join(verdict.problems.values()))

    async def at_load(self, name: str, entry: Entry, holders: list[Replica]) -> tuple[Entry, dict[Replica, str]]:
        """Right after `name` was loaded as `entry` on `holders`: (the entry with the references the first attesting
        replica of each group set, the replicas whose engine disagrees with why)."""
        reports = await asyncio.gather(*(self.read(replica, [name]) for replica in holders))
        odd: dict[Replica, str] = {}
        for replica, report in zip(holders, reports, strict=True):
            held = report.adapters.get(name) if report is not None else None
            if report is None:
                continue
            why = f"{name} is not registered in the engine after its load" if held is None else None
            if held is not None:
                why, entry = compare(name, entry, report.group, held)
            if why is not None:
                odd[replica] = why
            self.accept(replica, report, Verdict({name: why} if why else {}, {}), partial=True)
        return entry, odd

    async def round(self) -> None:
        """Every ready replica attests; one that disagrees is distrusted (out of routing, re-synced)."""
        self.rounds += 1
        fleet = self.fleet
        for replica in fleet.ready():
            epoch = fleet.broadcast_epoch
            report = await self.read(replica)
            listed = await replica.client.loaded_adapters() if report is not None else {}
            if report is None or not unchanged_since(fleet, epoch):
                continue  # a broadcast ran meanwhile: the report may predate it
            verdict = self.verdict(replica, report, listed)
            if verdict.problems:
                self.metrics.attestation_disagreements.inc()
                fleet.distrust(replica, list(verdict.problems), "attestation: " + "; ".join(verdict.problems.values()))
