"""The circuit breaker: a ready replica whose routed generations keep failing is taken out of routing.

A replica that answers /health can still fail every generation (an engine that broke after start). The front
reports each routed generation's outcome; the breaker trips on PROXY_BREAKER_FAILURES failures in a row, or on a
PROXY_BREAKER_FAILURE_RATE share of the last PROXY_BREAKER_WINDOW once half the window is filled. A tripped replica
is ejected and comes back only after a backoff, through the warm-up (it must generate again).
"""

from __future__ import annotations

import time
from typing import Protocol

from lorafleet.settings import ProxySettings

from .admission import backoff_s
from .metrics import Metrics
from .replica_state import Replica, State


class BreakerFleet(Protocol):
    """What the breaker needs of the fleet (fleet.Fleet is one): to eject a replica."""

    def eject(self, replica: Replica, error: str) -> None: ...


class CircuitBreaker:
    """Counts routed generations per replica (each replica keeps its window) and ejects through the fleet."""

    def __init__(self, fleet: BreakerFleet, settings: ProxySettings, metrics: Metrics) -> None:
        self.fleet = fleet
        self.settings = settings
        self.metrics = metrics

    def count(self, replica: Replica, failed: bool, reason: str = "") -> None:
        """One routed generation's outcome; trips (ejects) a replica whose generations keep failing."""
        window = self.settings.proxy_breaker_window
        replica.outcomes.append(failed)
        if len(replica.outcomes) > window:
            replica.outcomes.popleft()
        replica.failing = replica.failing + 1 if failed else 0
        if not failed or replica.state is not State.READY:
            return
        share = sum(replica.outcomes) / len(replica.outcomes)
        in_a_row = replica.failing >= self.settings.proxy_breaker_failures
        if in_a_row or (len(replica.outcomes) * 2 >= window and share >= self.settings.proxy_breaker_failure_rate):
            why = (f"{replica.failing} generations failed in a row" if in_a_row else
                   f"{share:.0%} of the last {len(replica.outcomes)} generations failed")
            self.metrics.breaker_trips.inc()
            replica.outcomes.clear()
            replica.failing = 0
            replica.sync_failures += 1  # it comes back after a backoff, through the warm-up (it must generate)
            self.fleet.eject(replica, f"circuit breaker: {why}; last: {reason}")
            replica.next_sync_at = time.monotonic() + backoff_s(self.settings, replica.sync_failures)
