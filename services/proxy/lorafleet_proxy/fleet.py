"""The fleet: its replicas, the states they move through, and the supervised loops that watch them.

    discovered -> joining --/health 200--> syncing: warm-up, then catch-up --> ready --misbehaves--> ejected
                                              ^                                 |                      |
                                              +---- adapters/pause differ -----+   answers again ------+

`Fleet` owns the replicas and every change of their state: membership (discovery, removal), the transitions
(`begin_sync`, `mark_ready` at the end of a catch-up, `eject`, `resync`, `quarantine`) and what a broadcast
changes (`mark_loaded`, `mark_unloaded`, `record_load`, ...): the other modules ask it by name and never write a
replica's state or the ledger themselves. Each job has its own module: admission.py (the warm-up and the catch-up,
scheduled with backoff), health.py (the health loop, failures toward ejection), breaker.py (the circuit breaker),
canary_watch.py (the canary's rounds and verdicts), ledger_rebuild.py (an unreadable ledger rebuilt). Each of them,
and broadcast.py, ratio_verdict.py and the runs, names the few actions it needs of the fleet as a Protocol of its own
(`HealthFleet`, `BroadcastFleet`, ...) that `Fleet` satisfies: they never import this module. The loops are
supervised: an unexpected error is logged and counted in `lorafleet_proxy_loop_errors_total` while the loop goes
on. The states and their reasons: docs/concepts/fleet-state.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from lorafleet.ledger_format import Entry, LedgerState, RunRecord
from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMClient

from .admission import Admission
from .attestation import AttestationWatch
from .breaker import CircuitBreaker
from .canary import Key
from .canary_watch import CanaryWatch
from .discovery import resolve
from .health import HealthChecks
from .ledger import Ledger, LedgerWriteError
from .metrics import Metrics
from .replica_state import Failure, Replica, State, upstream_pool
from .router import Router

log = logging.getLogger("lorafleet.proxy.fleet")

__all__ = ["Fleet", "Replica", "State"]


class Fleet:
    """The replicas, their states and the background loops that keep them in line with the ledger."""

    def __init__(self, settings: ProxySettings, router: Router, ledger: Ledger,
                 transport: httpx.AsyncBaseTransport | None = None, metrics: Metrics | None = None) -> None:
        # The parts it is built with are its own: other modules ask the fleet by name (test_module_graph checks).
        self.settings = settings
        self.router = router
        self.ledger = ledger
        self.metrics = metrics or Metrics()
        self.transport = transport  # None = the network; tests pass an in-process transport
        self.replicas: dict[str, Replica] = {}
        self.lock = asyncio.Lock()  # held by broadcasts and by a sync's final check: one consistent ledger view
        self.broadcast_epoch = 0  # bumped when a broadcast starts and ends: a snapshot read meanwhile is stale
        self.heartbeat = 0.0  # monotonic time of the last completed health round
        self._retired: list[Replica] = []  # removed replicas whose pools close once their requests are done
        self._tasks: list[asyncio.Task[None]] = []
        self._admission = Admission(self, settings, router, self.metrics)
        self._health = HealthChecks(self, settings, ledger, self.metrics, self._admission)
        self._breaker = CircuitBreaker(self, settings, self.metrics)
        self._canary = CanaryWatch(self, settings, ledger, self.metrics)
        self._attestation = AttestationWatch(self, self.metrics)
        # Told (url, why) when a replica is ejected: the front gives up its requests in flight (Upstreams.abandon).
        self.on_eject: list[Callable[[str, str], None]] = []

    @contextlib.asynccontextmanager
    async def broadcasting(self) -> AsyncIterator[None]:
        """Hold the lock for a fleet-wide change; the broadcast epoch moves on at both ends."""
        async with self.lock:
            self.broadcast_epoch += 1
            try:
                yield
            finally:
                self.broadcast_epoch += 1

    # --- the ledger, as broadcasts read and change it --------------------------------------------
    @property
    def paused(self) -> str | None:
        """The fleet's pause mode as the ledger records it (None: running)."""
        return self.ledger.paused

    @property
    def rebuilding(self) -> bool:
        """The ledger file was unusable and is not rebuilt yet: no fleet-wide change may run."""
        return self.ledger.rebuilding

    @property
    def unreadable_reason(self) -> str:
        return self.ledger.unreadable_reason

    def published(self, name: str) -> bool:
        """Whether `name` is an adapter of the ledger: one the fleet serves, whether or not a replica holds it now."""
        return self.ledger.get(name) is not None

    @property
    def adapter_root(self) -> Path:
        """Where every adapter the fleet loads must live (ADAPTER_ROOT)."""
        return self.settings.adapter_root

    @property
    def load_timeout_s(self) -> float:
        """How long an adapter load may take on every replica (PROXY_LORA_LOAD_TIMEOUT_S)."""
        return self.settings.proxy_lora_load_timeout_s

    def wanted(self) -> dict[str, Entry]:
        """The adapters every ready replica must hold, in load order (a copy of the ledger's)."""
        return self.ledger.entries()

    def recorded(self, name: str) -> Entry | None:
        """The ledger's entry for adapter `name`."""
        return self.ledger.get(name)

    def snapshot(self) -> LedgerState:
        """A copy of the ledger's state: to plan a change on, or to restore after one failed."""
        return self.ledger.state()

    def commit(self, state: LedgerState) -> LedgerWriteError | None:
        """Persist `state` as the ledger; the error (counted) when it could not be written."""
        try:
            self.ledger.commit(state)
        except LedgerWriteError as exc:
            self.metrics.ledger_write_failures.inc()
            return exc
        return None

    def record_load(self, name: str, entry: Entry, runs: dict[str, RunRecord]) -> LedgerWriteError | None:
        """The ledger holds `name` as `entry`, last in load order, and `runs` as its runs (as the load's admission
        left them); nothing is written when it held exactly that already."""
        state = self.ledger.state()
        state.runs = runs
        state.adapters.pop(name, None)
        state.adapters[name] = entry
        return None if state.same_as(self.ledger.state()) else self.commit(state)

    def record_references(self, entries: dict[str, Entry]) -> LedgerWriteError | None:
        """Attestation references for entries the ledger still holds at the same path (nothing written when none)."""
        state = self.ledger.state()
        changed = {name: entry for name, entry in entries.items()
                   if (known := state.adapters.get(name)) is not None and known.path == entry.path and known != entry}
        if not changed:
            return None
        state.adapters.update(changed)  # known names: their place in load order stays
        return self.commit(state)

    def record_unload(self, name: str) -> LedgerWriteError | None:
        """The ledger no longer holds `name` (nothing is written when it did not)."""
        state = self.ledger.state()
        if state.adapters.pop(name, None) is None:
            return None
        return self.commit(state)

    def record_pause(self, mode: str | None) -> LedgerWriteError | None:
        """The ledger records the fleet paused in `mode` (None: running)."""
        state = self.ledger.state()
        state.paused = mode
        return self.commit(state)

    # --- what a broadcast changed ----------------------------------------------------------------
    def mark_loaded(self, name: str, entry: Entry) -> None:
        """Every ready replica holds `name` as `entry`: routable there from now on."""
        for replica in self.ready():
            replica.adapters[name] = entry.path
            replica.held[name] = entry

    def mark_unloaded(self, name: str, replicas: list[Replica]) -> None:
        """`name` is gone from these replicas: dropped from the router and from their views; once it is out of the
        ledger too, its canary references and answer counts go (bounded memory and metric labels)."""
        self.router.drop_adapter(name)
        for replica in replicas:
            replica.adapters.pop(name, None)
            replica.held.pop(name, None)
            replica.served.pop(name, None)
        if self.ledger.get(name) is None:
            self._canary.forget(name)
            self.metrics.forget_answers(adapter=name)

    def prefix_caches_reset(self) -> None:
        """The replicas' prefix caches were reset: no prefix is cached anywhere, routing forgets them all."""
        self.router.clear()

    def rolled_back(self, operation: str) -> None:
        """A partial broadcast of `operation` was undone on the replicas that had applied it (counted)."""
        self.metrics.rollbacks.labels(operation).inc()

    # --- membership ------------------------------------------------------------------------------
    def ready(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.state is State.READY]

    def set_members(self, urls: list[str]) -> None:
        for url in urls:
            if url not in self.replicas:
                http = upstream_pool(self.transport)
                token = self.settings.proxy_upstream_token
                self.replicas[url] = Replica(url, http, VLLMClient(url, token=token, client=http))
                log.info("replica discovered url=%s", url)
        for url in [url for url in self.replicas if url not in urls]:
            self._remove(url)

    def _remove(self, url: str) -> None:
        replica = self.replicas.pop(url)
        self._admission.cancel(replica)
        replica.state = State.EJECTED
        self.router.forget_replica(url)
        self._retired.append(replica)
        for per_replica in (self.metrics.inflight, self.metrics.replica_adapters):
            with contextlib.suppress(KeyError):
                per_replica.remove(url)
        self.metrics.forget_answers(replica=url)
        log.warning("replica removed url=%s (no longer discovered) state=%s", url, replica.state)

    async def _close_retired(self) -> None:
        """Close the pools of removed replicas once their requests are done."""
        for replica in [r for r in self._retired if r.inflight == 0]:
            self._retired.remove(replica)
            await replica.http.aclose()

    def loops_alive(self) -> bool:
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    async def start(self) -> None:
        if self.settings.proxy_upstream_dns:
            await self._discover()
            self._tasks.append(asyncio.create_task(
                self._supervised("dns", self._discover, self.settings.proxy_dns_interval_s), name="proxy-dns"))
        else:
            self.set_members(self.settings.upstream_urls)
        self._tasks.append(asyncio.create_task(
            self._supervised("health", self.health_round, self.settings.proxy_health_interval_s),
            name="proxy-health"))

    def supervise(self, loop: str, body: Callable[[], Awaitable[None]], interval_s: float) -> None:
        """One more supervised loop for the life of the proxy (runs' leases); counted by `loops_alive`."""
        self._tasks.append(asyncio.create_task(self._supervised(loop, body, interval_s), name=f"proxy-{loop}"))

    async def stop(self) -> None:
        for replica in self.replicas.values():
            self._admission.cancel(replica)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._admission.cancelled, return_exceptions=True)
        for replica in [*self.replicas.values(), *self._retired]:
            await replica.http.aclose()
        self._retired.clear()

    async def _supervised(self, loop: str, body: Callable[[], Awaitable[None]], interval_s: float) -> None:
        """Run `body` every `interval_s` for the life of the proxy: an exception is logged, counted, survived."""
        while True:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any bug or odd answer
                self.metrics.loop_errors.labels(loop).inc()
                log.exception("%s loop: unexpected error (the loop goes on)", loop)
            await asyncio.sleep(interval_s)

    async def _discover(self) -> None:
        try:
            self.set_members(await resolve(self.settings.proxy_upstream_dns))
        except OSError as exc:
            log.warning("dns: cannot resolve %s: %s (keeping %d replica(s))", self.settings.proxy_upstream_dns,
                        exc, len(self.replicas))

    # --- a replica's state -----------------------------------------------------------------------
    def begin_sync(self, replica: Replica) -> None:
        """A sync starts (admission.py): the replica is out of routing until its catch-up marks it ready."""
        replica.state = State.SYNCING
        self.router.forget_replica(replica.url)

    def mark_ready(self, replica: Replica, adapters: dict[str, str]) -> None:
        """A catch-up ended with the replica holding the ledger (`adapters`: name -> path): routable from now on."""
        replica.adapters = adapters
        replica.state = State.READY
        replica.last_error = None
        replica.sync_failures = 0

    def eject(self, replica: Replica, error: str) -> None:
        """Out of traffic and broadcasts now; when it answers health checks again it re-syncs to the ledger."""
        if replica.state not in (State.SYNCING, State.READY):
            return
        self._admission.cancel(replica)
        replica.state = State.EJECTED
        replica.last_error = error
        replica.adapters = {}
        replica.engine_queue = 0
        replica.next_sync_at = 0.0
        self.router.forget_replica(replica.url)
        self.metrics.ejections.inc()
        log.warning("replica ejected url=%s failures=%d error=%s", replica.url, replica.failures, error)
        for observer in self.on_eject:
            observer(replica.url, f"ejected: {error}")

    def resync(self, replica: Replica, reason: str) -> None:
        """Take a replica out of traffic and bring it back in line with the ledger."""
        if replica.state is State.EJECTED:
            return
        log.warning("replica resync url=%s reason=%s", replica.url, reason)
        replica.last_error = reason
        replica.state = State.SYNCING
        replica.adapters = {}
        self.router.forget_replica(replica.url)
        self._admission.cancel(replica)
        self._admission.start(replica)

    def quarantine(self, replica: Replica, subject: str, reason: str) -> None:
        """The canary doubts `replica`'s weights for `subject`: out of routing now, re-synced with that adapter
        reloaded and its prefix cache reset, and probed again before it is ready."""
        if replica.state is not State.READY and replica.state is not State.SYNCING:
            return
        self.metrics.canary_disagreements.inc()
        replica.suspect.add(subject)
        replica.canary_failure = reason
        log.error("replica quarantined by the canary url=%s subject=%s: %s", replica.url, subject or "base", reason)
        self.resync(replica, f"canary: {reason}")

    def distrust(self, replica: Replica, subjects: list[str], reason: str) -> None:
        """The replica's engine attested other weights than the ledger's (attestation.py): out of routing now,
        re-synced with `subjects` reloaded, ready again only once it attests correctly."""
        if replica.state is not State.READY and replica.state is not State.SYNCING:
            return
        replica.suspect.update(subject for subject in subjects if subject)
        log.error("replica distrusted by attestation url=%s subjects=%s: %s", replica.url, subjects, reason)
        self.resync(replica, reason)

    async def recheck(self, subject: str, replicas: list[Replica], why: str) -> None:
        """The last ready holders of `subject` doubted: re-loaded in place and probed again (canary_watch.py)."""
        await self._canary.recheck(subject, replicas, why)

    # --- reports and rounds, each done by its job's module ----------------------------------------
    async def health_round(self) -> None:
        """Check every replica, rebuild an unreadable ledger (health.py), close retired pools; the heartbeat moves."""
        await self._health.round()
        await self._close_retired()
        self.heartbeat = time.monotonic()

    async def check(self, replica: Replica) -> bool:
        return await self._health.check(replica)

    def note_failure(self, replica: Replica, error: str, kind: Failure = "status") -> None:
        """A failed health check or routed call, counted toward the replica's ejection (health.py)."""
        self._health.note_failure(replica, error, kind)

    def generation_done(self, replica: Replica, failed: bool, reason: str = "") -> None:
        """One routed generation's outcome, for the circuit breaker (breaker.py)."""
        self._breaker.count(replica, failed, reason)

    async def judge(self, subject: str, replicas: list[Replica], key: Key | None = None,
                    ) -> tuple[list[Replica], bool, str]:
        """The canary's verdict on `replicas` for `subject`: (the odd ones, decided, why) (canary_watch.py)."""
        return await self._canary.judge(subject, replicas, key)

    async def verify(self, replica: Replica) -> None:
        """The checks at the end of a catch-up: attestation (raises AttestationDisagreement, attestation.py), then
        the canary's (raises CanaryDisagreement, canary_watch.py)."""
        await self._attestation.check(replica)
        await self._canary.verify(replica)

    def load_phase(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Times one phase of an adapter load (metrics.LOAD_PHASES)."""
        return self.metrics.load_phase(phase)

    async def attest_load(self, name: str, entry: Entry, holders: list[Replica]) -> tuple[Entry, dict[Replica, str]]:
        """Attestation right after a load: (the entry with its references, the disagreeing replicas and why)."""
        return await self._attestation.at_load(name, entry, holders)

    async def attestation_round(self) -> None:
        await self._attestation.round()

    def canary_subjects(self) -> list[str]:
        return self._canary.subjects()

    async def canary_round(self) -> None:
        await self._canary.round()
