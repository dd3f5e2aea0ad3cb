"""The health loop: every replica checked each PROXY_HEALTH_INTERVAL_S, each check isolated from the others.

A check asks /health; a ready replica is then compared with the ledger (a restarted one lost its adapters and pause
state: it re-syncs), any other is admitted when its sync is due. Failures count toward ejection by their kind:
refused or reset ejects at once, timeouts only after PROXY_EJECT_SLOW_AFTER_S of them, anything else after
PROXY_EJECT_AFTER in a row. The round also rebuilds an unreadable ledger from the replicas that answered
(ledger_rebuild.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import httpx
from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMError, VLLMUnreachable, metric_total

from .admission import Admission
from .epoch import Broadcasts, unchanged_since
from .ledger import Ledger
from .ledger_rebuild import rebuild_ledger
from .metrics import Metrics
from .replica_state import Failure, Replica, State
from .sync import mismatch


class HealthFleet(Broadcasts, Protocol):
    """What the health loop needs of the fleet (fleet.Fleet is one): its replicas, and to eject or re-sync one."""

    replicas: dict[str, Replica]

    def eject(self, replica: Replica, error: str) -> None: ...

    def resync(self, replica: Replica, reason: str) -> None: ...


def failure_kind(exc: VLLMError) -> Failure:
    """Refused or reset = the replica died; a timeout = it may only be busy; anything else = a bad answer."""
    if not isinstance(exc, VLLMUnreachable):
        return "status"
    return "timeout" if isinstance(exc.__cause__, httpx.TimeoutException) else "refused"


class HealthChecks:
    """The health rounds, and the count of a replica's failures (checks and routed calls) toward its ejection."""

    def __init__(self, fleet: HealthFleet, settings: ProxySettings, ledger: Ledger, metrics: Metrics,
                 admission: Admission) -> None:
        self.fleet = fleet
        self.settings = settings
        self.ledger = ledger
        self.metrics = metrics
        self.admission = admission

    async def round(self) -> None:
        """Check every replica (isolated from each other), then rebuild an unreadable ledger from those answering."""
        replicas = list(self.fleet.replicas.values())
        healthy = await asyncio.gather(*(self.check(replica) for replica in replicas))
        if self.ledger.rebuilding:
            answering = [replica for replica, ok in zip(replicas, healthy, strict=True) if ok]
            await rebuild_ledger(self.ledger, self.metrics, answering, self.note_failure)

    async def check(self, replica: Replica) -> bool:
        """One health check, isolated: True when the replica answered. Never raises (but for cancellation)."""
        limit = 2 * self.settings.proxy_health_timeout_s
        try:
            async with asyncio.timeout(limit):  # one stuck replica must not stall the round for the others
                failure = await self._probe(replica)
                if failure is not None:
                    self.note_failure(replica, failure[1], failure[0])
                    return False
                replica.slow_since = None
                if replica.state is State.READY:
                    await self._reconcile(replica)
                elif self.admission.due(replica, self.ledger.rebuilding):
                    self.admission.start(replica)
            replica.failures = 0  # only a whole check that passed clears the count
            return True
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.note_failure(replica, f"health check: no complete answer within {limit:.1f}s", "timeout")
            return False
        except VLLMError as exc:
            self.note_failure(replica, f"health check: {exc}", failure_kind(exc))
            return False
        except Exception as exc:  # a malformed answer fails this replica's check only
            self.note_failure(replica, f"malformed reply: {type(exc).__name__}: {exc}", "malformed")
            return False

    async def _probe(self, replica: Replica) -> tuple[Failure, str] | None:
        try:
            await replica.client.request("GET", "/health", timeout=self.settings.proxy_health_timeout_s)
        except VLLMError as exc:
            return failure_kind(exc), f"health check: {exc}"
        return None

    def note_failure(self, replica: Replica, error: str, kind: Failure = "status") -> None:
        """A failed health check or routed call. Refused/reset ejects at once; timeouts only after
        PROXY_EJECT_SLOW_AFTER_S of them; other failures after PROXY_EJECT_AFTER in a row."""
        self.metrics.check_failures.labels(kind).inc()
        replica.last_error = error
        if kind == "refused":
            self.fleet.eject(replica, error)
        elif kind == "timeout":
            now = time.monotonic()
            replica.slow_since = replica.slow_since or now
            if now - replica.slow_since >= self.settings.proxy_eject_slow_after_s:
                # kept on every later timeout too: an operator sees how long an ejected replica has been hanging
                replica.last_error = f"{error} (timing out for {now - replica.slow_since:.0f}s)"
                self.fleet.eject(replica, replica.last_error)
        else:
            replica.failures += 1
            if replica.failures >= self.settings.proxy_eject_after:
                self.fleet.eject(replica, error)

    async def _reconcile(self, replica: Replica) -> None:
        """Compare a ready replica's adapters and pause state with the ledger (a restarted replica lost both)."""
        fleet = self.fleet
        epoch = fleet.broadcast_epoch
        listed = await replica.client.loaded_adapters()
        paused = await replica.client.is_paused()
        with contextlib.suppress(VLLMError, ValueError):
            text = await replica.client.metrics()
            replica.engine_queue = int(metric_total(text, "vllm:num_requests_running")
                                       + metric_total(text, "vllm:num_requests_waiting"))
        if not unchanged_since(fleet, epoch) or replica.state is not State.READY:
            return  # a broadcast ran (or runs) meanwhile: this snapshot may predate it
        replica.observe(listed)
        problem = mismatch(replica, listed, paused, self.ledger.entries(), self.ledger.paused)
        if problem is not None:
            fleet.resync(replica, f"{problem} (restarted?)")
