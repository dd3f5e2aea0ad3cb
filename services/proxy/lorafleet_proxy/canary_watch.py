"""The fleet's use of the agreement canary (canary.py): which subjects are probed, on which replicas, and when.

Three moments: a load answers only after the canary judged the replicas that loaded it (broadcast.py asks
`judge`); a catch-up ends with the syncing replica agreeing with every agreed answer (`verify`); and a periodic
round (PROXY_CANARY_INTERVAL_S) probes the base model and each run's newest adapter on every ready replica that
serves it. A replica whose answer departs is quarantined through the fleet while another ready replica serves the
subject; the last ready holders are re-loaded in place, their cache reset, and probed again instead (`recheck`), so
a fleet of one never answers 503 on a verdict only its own earlier answer could give. Why:
docs/concepts/provenance.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMError

from .canary import BASE_SUBJECT, Canary, CanaryAnswer, Key, describe, full_precision
from .epoch import Broadcasts, unchanged_since
from .ledger import Ledger
from .metrics import Metrics
from .replica_state import Replica, State


class CanaryFleet(Broadcasts, Protocol):
    """What the canary's rounds need of the fleet (fleet.Fleet is one): its replicas, the ready ones, its pause, and
    to quarantine a replica."""

    replicas: dict[str, Replica]

    @property
    def paused(self) -> str | None: ...

    def ready(self) -> list[Replica]: ...

    def quarantine(self, replica: Replica, subject: str, reason: str) -> None: ...

log = logging.getLogger("lorafleet.proxy.fleet")


class CanaryDisagreement(VLLMError):
    """A syncing replica's canary answer departs from the fleet's agreed answer: it stays out of routing."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, "CanaryDisagreement")
        self.args = (message,)  # read as what it says, not as an HTTP status


class CanaryWatch:
    """Probes the fleet's subjects and acts on the verdicts; the canary's references live as long as the proxy."""

    def __init__(self, fleet: CanaryFleet, settings: ProxySettings, ledger: Ledger, metrics: Metrics) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.metrics = metrics
        self.canary = Canary(settings, metrics)

    def subject_key(self, subject: str, replica: Replica | None = None) -> Key:
        """What a subject's reference is kept under: an adapter's content (fingerprint, else path), the base
        model's name."""
        if subject == BASE_SUBJECT:
            info = replica.info if replica is not None else next((r.info for r in self.fleet.ready() if r.info), None)
            return subject, info.model if info is not None else ""
        entry = self.ledger.get(subject)
        return subject, (entry.fingerprint or entry.path) if entry is not None else ""

    def probe_model(self, subject: str, replica: Replica) -> str:
        if subject != BASE_SUBJECT:
            return subject
        return replica.info.model if replica.info is not None else next(
            (r.info.model for r in self.fleet.ready() if r.info is not None), "")

    def tolerance(self, replicas: list[Replica]) -> float:
        """The tolerance the answers of `replicas` are judged by: the setting, else their dtypes' noise bound."""
        return self.canary.tolerance_of(dtypes(replicas))

    @staticmethod
    def forced(replicas: list[Replica]) -> bool:
        """Whether `replicas` are probed teacher-forced (any of them in 16 bits), else greedily (canary.py)."""
        return not full_precision(dtypes(replicas))

    async def judge(self, subject: str, replicas: list[Replica], key: Key | None = None,
                    ) -> tuple[list[Replica], bool, str]:
        """Probe `replicas` for `subject` and judge their answers: (the odd ones, decided, why); `key` where the
        ledger does not hold the subject yet (a load being answered)."""
        if not replicas:
            return [], True, ""
        model = self.probe_model(subject, replicas[0])
        answers = await self.canary.probe_all(model, {r.url: r.client for r in replicas}, self.forced(replicas))
        verdict = self.canary.judge(key or self.subject_key(subject, replicas[0]), answers, self.tolerance(replicas))
        self.canary.learn(dtypes(replicas), verdict)
        return [r for r in replicas if r.url in verdict.odd], verdict.decided, verdict.why

    async def verify(self, replica: Replica) -> None:
        """The end of a catch-up: the replica answers every subject with an agreed answer as agreed, or stays out
        (raises CanaryDisagreement). Subjects without a reference yet are judged at the next round."""
        subjects = [BASE_SUBJECT, *self.ledger.entries()]
        judged = [subject for subject in subjects if self.subject_key(subject, replica) in self.canary.references]
        # All at once: one engine batch, so a catch-up is not outrun by the versions a trainer publishes meanwhile.
        answers = await asyncio.gather(*(self.canary.probe(replica.client, self.probe_model(subject, replica),
                                                           self.forced([replica])) for subject in judged))
        for subject, answer in zip(judged, answers, strict=True):
            key = self.subject_key(subject, replica)
            if answer is None:
                raise CanaryDisagreement(f"canary: no usable answer for {subject or 'the base model'}")
            tolerance = self.tolerance([replica])
            if self.canary.agrees_with_reference(key, answer, tolerance) is not False:
                continue
            reference = self.canary.references[key]
            distance = answer.distance(reference)
            outvoted = await self.outvotes_reference(subject, key, replica, answer)
            if outvoted is None and self.canary.renewable(distance, tolerance):
                # No peer to ask, it has just loaded the published files into a reset cache, and it departs no
                # further than the same weights' numbers drift: the reference is what aged.
                self.canary.rebaseline(key, answer, f"{replica.url}, alone at its catch-up, departs from the "
                                       f"reference ({describe(distance, tolerance)})")
            elif not outvoted:
                reason = (f"canary: departs from the agreed answer for {subject or 'the base model'} at catch-up "
                          f"({describe(distance, tolerance)})")
                # Doubted like a quarantine: the next catch-up reloads it and resets the cache, instead of finding
                # the same name and path loaded and probing the same wrong weights forever.
                if subject not in replica.suspect:  # a quarantine counted it already, and its reason stays
                    self.metrics.canary_disagreements.inc()
                    replica.suspect.add(subject)
                replica.canary_failure = replica.canary_failure or reason
                raise CanaryDisagreement(reason)
        replica.canary_failure = None
        replica.suspect.clear()

    async def outvotes_reference(self, subject: str, key: Key, replica: Replica, answer: CanaryAnswer,
                                 ) -> bool | None:
        """Whether a catch-up's departure from the reference is the reference's age, not the replica's weights: the
        other replicas that serve the subject now (ready or catching up) are probed with it, and a strict majority
        that includes it becomes the reference, as a round's majority would. A reference can go stale while the
        weights stay: a CPU replica's logprobs move once adapters are loaded beside the base model, and a fleet whose
        every replica re-syncs (after a quarantine) would otherwise be held out by an answer none gives any more.
        None: no peer serves the subject. Not while the fleet is paused: the probes would wait in the replicas'
        queues."""
        if self.fleet.paused:
            return False
        holders = [r for r in self.fleet.replicas.values() if r is not replica
                   and r.state in (State.READY, State.SYNCING) and (subject == BASE_SUBJECT or subject in r.adapters)]
        if not holders:
            return None
        peers = {r.url: r.client for r in holders}
        answers = {replica.url: answer, **await self.canary.probe_all(self.probe_model(subject, replica), peers,
                                                                      self.forced([replica, *holders]))}
        verdict = self.canary.judge(key, answers, self.tolerance([replica, *holders]))
        self.canary.learn(dtypes([replica, *holders]), verdict)
        return verdict.decided and replica.url not in verdict.odd

    def subjects(self) -> list[str]:
        """The base model and the newest adapter of each run (the versions rollouts are sampled with now)."""
        newest: dict[str, str] = {}
        for name, entry in self.ledger.entries().items():
            newest[entry.run] = name  # the ledger keeps load order: the last one of a run is its newest
        return [BASE_SUBJECT, *newest.values()]

    async def round(self) -> None:
        """The periodic round: every subject on every ready replica that serves it; odd replicas quarantined while
        another ready replica serves the subject, else re-checked in place (`recheck`)."""
        fleet = self.fleet
        self.canary.rounds += 1
        self.canary.last_round = time.monotonic()
        for subject in self.subjects():
            epoch = fleet.broadcast_epoch
            holders = [r for r in fleet.ready() if subject == BASE_SUBJECT or subject in r.adapters]
            odd, decided, why = await self.judge(subject, holders)
            if not unchanged_since(fleet, epoch):
                continue  # a broadcast ran meanwhile: these answers may predate it
            if not decided and len(holders) > 1:
                log.warning("canary undecided subject=%s: %s", subject or "base", why)
            if odd and len(odd) == len(holders):
                await self.recheck(subject, odd, why)
                continue
            for replica in odd:
                fleet.quarantine(replica, subject, why)

    async def recheck(self, subject: str, replicas: list[Replica], why: str) -> None:
        """Every ready holder of `subject` departs from its reference: nothing in the fleet could serve it in their
        place, and a reference is only an earlier answer. Each is re-loaded in place from the published files (an
        adapter; the base model cannot be), its prefix cache reset, and probed again. An answer that agrees again
        ends it. One that departs no further than the same weights' numbers drift (`Canary.renewable`), from
        replicas that agree among themselves, renews the reference. One that departs further is other weights:
        quarantined, even if that leaves no replica for the subject (a 503 says so; wrong weights would not). Noise
        never takes the last holder out."""
        fleet = self.fleet
        epoch = fleet.broadcast_epoch
        self.metrics.canary_rechecks.inc(len(replicas))
        log.warning("canary recheck subject=%s replicas=%s: %s", subject or "base", [r.url for r in replicas], why)
        entry = self.ledger.get(subject) if subject != BASE_SUBJECT else None
        for replica in replicas:
            try:
                if entry is not None:
                    await replica.client.load_lora_adapter(subject, entry.path, load_inplace=True)
                await replica.client.reset_prefix_cache()
            except VLLMError as exc:  # a replica that cannot reload is the health loop's and breaker's to judge
                log.warning("canary recheck could not reload url=%s subject=%s: %s", replica.url, subject or "base",
                            exc)
        key = self.subject_key(subject, replicas[0])
        answers = await self.canary.probe_all(self.probe_model(subject, replicas[0]),
                                              {r.url: r.client for r in replicas}, self.forced(replicas))
        reference = self.canary.references.get(key)
        if not unchanged_since(fleet, epoch) or not answers or reference is None:
            return
        tolerance = self.tolerance(replicas)
        distances = {url: answer.distance(reference) for url, answer in answers.items()}
        departing = {url: distance for url, distance in distances.items() if distance > tolerance}
        if not departing:
            log.info("canary recheck agrees again subject=%s", subject or "base")
            return
        for replica in replicas:
            if replica.url in departing and not self.canary.renewable(departing[replica.url], tolerance):
                fleet.quarantine(replica, subject, f"{replica.url} departs from the reference after a reload "
                                 f"({describe(departing[replica.url], tolerance)}): other weights, not noise")
        drifted = [answers[url] for url in departing if self.canary.renewable(departing[url], tolerance)]
        if len(drifted) == len(answers) and all(answer.agrees(drifted[0], tolerance) for answer in drifted):
            self.canary.rebaseline(key, drifted[0], f"the last ready holders, re-loaded, still depart: {why}")
        elif drifted:
            self.metrics.canary_undecided.inc()
            log.error("canary recheck undecided subject=%s: the last ready holders answer differently after a reload "
                      "and nothing can tell which is right; left serving: %s", subject or "base", why)

    def forget(self, subject: str) -> None:
        """The subject left the fleet (an adapter unloaded everywhere and out of the ledger): its references go."""
        self.canary.forget(subject)


def dtypes(replicas: list[Replica]) -> list[str | None]:
    """The dtypes `replicas` reported at admission (None where not read yet)."""
    return [r.info.dtype if r.info is not None else None for r in replicas]
