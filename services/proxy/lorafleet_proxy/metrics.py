"""The proxy's own Prometheus metrics, in a registry per app (tests build several apps in one process).

Names follow Prometheus conventions: the `lorafleet_proxy_` prefix, base units in the name
(`_seconds`), and counters exposed with `_total` (prometheus_client appends it). The Grafana
dashboard (monitoring/grafana/dashboards/lorafleet.json) and the live test that runs its queries
rely on these names: rename one here and there together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Fleet-wide operations and the ones a partial failure rolls back: their series exist (at 0) from the start, so a
# healthy fleet's dashboard shows "0 failures" rather than "no data".
BROADCAST_OPS = ("load", "unload", "pause", "resume", "reset_prefix_cache")
ROLLBACK_OPS = ("load", "pause")
BROADCAST_OUTCOMES = ("ok", "rejected", "failed")  # 2xx/3xx, 4xx (the request), 5xx (the fleet)
LOAD_PHASES = ("store", "load", "canary", "attest", "ledger")  # an adapter load's steps, in order (broadcast.py)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lorafleet_proxy_requests", "Requests served, by route and status.",
                                ["route", "status"], registry=r)
        self.upstream_latency = Histogram("lorafleet_proxy_upstream_request_duration_seconds",
                                          "Routed request time at the replica (until headers for streams).",
                                          ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_retries = Counter("lorafleet_proxy_upstream_retries",
                                        "Routed requests retried on another replica, by reason.", ["reason"],
                                        registry=r)
        self.router = Counter("lorafleet_proxy_routing_decisions", "Routing decisions by outcome.", ["outcome"],
                              registry=r)
        self.tracked_blocks = Gauge("lorafleet_proxy_router_tracked_blocks", "Blocks in the routing table.",
                                    registry=r)
        self.broadcasts = Counter("lorafleet_proxy_broadcasts",
                                  "Fleet-wide operations by operation and outcome (ok, rejected = 4xx, failed = 5xx).",
                                  ["op", "outcome"], registry=r)
        self.broadcast_seconds = Histogram("lorafleet_proxy_broadcast_duration_seconds",
                                           "Duration of fleet-wide operations.", ["op"], buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.load_phase_seconds = Histogram(
            "lorafleet_proxy_load_phase_seconds", "Where an adapter load's time goes, by phase: store (the copy into "
            "the content store), load (every replica's), canary, attest, ledger.", ["phase"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.rollbacks = Counter("lorafleet_proxy_broadcast_rollbacks",
                                 "Partial broadcasts undone on the replicas that had applied them, by operation.",
                                 ["op"], registry=r)
        self.replicas = Gauge("lorafleet_proxy_replicas", "Replicas by membership state.", ["state"], registry=r)
        self.inflight = Gauge("lorafleet_proxy_replica_inflight_requests", "Requests in flight per replica.",
                              ["replica"], registry=r)
        self.replica_adapters = Gauge("lorafleet_proxy_replica_adapters", "Adapters loaded per replica.",
                                      ["replica"], registry=r)
        self.replica_sync_seconds = Histogram("lorafleet_proxy_replica_sync_duration_seconds",
                                              "Time a replica took to catch up with the ledger before it got traffic.",
                                              buckets=LATENCY_BUCKETS, registry=r)
        self.ledger_size = Gauge("lorafleet_proxy_ledger_adapters", "Adapters in the fleet ledger.", registry=r)
        self.ejections = Counter("lorafleet_proxy_replica_ejections", "Replicas ejected after failed health checks.",
                                 registry=r)
        self.paused = Gauge("lorafleet_proxy_fleet_paused", "1 while the replicas are paused (generation stalls).",
                            registry=r)
        self.pause_seconds = Histogram("lorafleet_proxy_pause_duration_seconds",
                                       "How long the replicas stayed paused, pause to resume: the generation stall.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.pauses_elided = Counter("lorafleet_proxy_pauses_elided",
                                     "Keep pauses from the fleet port answered without pausing replicas "
                                     "(PROXY_SYNC_PAUSE=elide).", registry=r)
        self.loop_errors = Counter("lorafleet_proxy_loop_errors", "Unexpected errors survived by the supervised "
                                   "loops (health, dns) and by replica syncs, by loop.", ["loop"], registry=r)
        self.check_failures = Counter("lorafleet_proxy_replica_check_failures", "Failed replica checks by kind "
                                      "(refused, timeout, status, malformed).", ["kind"], registry=r)
        self.ledger_rebuilds = Counter("lorafleet_proxy_ledger_rebuilds", "Ledgers rebuilt from the replicas because "
                                       "the ledger file was unusable.", registry=r)
        self.ledger_write_failures = Counter("lorafleet_proxy_ledger_write_failures", "Ledger writes that failed "
                                             "(the broadcast that needed them failed).", registry=r)
        # --- runs sharing the fleet (runs.py, fairshare.py): the `run` label is a run name (bounded by the budget)
        self.run_tokens = Counter("lorafleet_proxy_run_tokens", "Tokens per run and kind (prompt, generated) of "
                                  "non-streamed answers, counted while runs share the fleet.", ["run", "kind"],
                                  registry=r)
        self.run_queue_wait = Histogram("lorafleet_proxy_run_queue_wait_seconds", "Time a run's generation request "
                                        "waited in the fair-share queue.", ["run"], buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.run_slots = Gauge("lorafleet_proxy_run_slots", "LoRA slots a run reserves on every replica.", ["run"],
                               registry=r)
        self.run_adapters = Gauge("lorafleet_proxy_run_adapters", "Adapters a run holds.", ["run"], registry=r)
        self.run_inflight = Gauge("lorafleet_proxy_run_inflight_requests", "A run's generation requests in flight "
                                  "or queued at the proxy.", ["run"], registry=r)
        self.run_share = Gauge("lorafleet_proxy_run_generated_share", "A run's share of the generated tokens.",
                               ["run"], registry=r)
        self.slots = Gauge("lorafleet_proxy_lora_slots", "The slot budget: capacity (smallest --max-loras), reserved "
                           "by runs, unreclaimed (unloaded, not yet evicted by vLLM's LRU).", ["kind"], registry=r)
        self.run_refusals = Counter("lorafleet_proxy_run_refusals", "Registrations and loads refused by the slot "
                                    "budget (409).", registry=r)
        self.run_expirations = Counter("lorafleet_proxy_run_expirations", "Runs expired after RUN_LEASE_S without a "
                                       "request (adapters unloaded fleet-wide).", registry=r)
        # --- provenance, the agreement canary, the circuit breaker (canary.py, breaker.py) -------------
        self.answers = Counter("lorafleet_proxy_answers", "Generation answers per replica and adapter (fleet name; the "
                               "base model as named): which weights served what. Series go with the adapter.",
                               ["replica", "adapter"], registry=r)
        self.canary_probes = Counter("lorafleet_proxy_canary_probes", "Canary probes sent to replicas.", registry=r)
        self.canary_probe_failures = Counter("lorafleet_proxy_canary_probe_failures", "Canary probes without a usable "
                                             "answer (no vote).", registry=r)
        self.canary_disagreements = Counter("lorafleet_proxy_canary_disagreements", "Replicas taken out of routing "
                                            "because their canary answer departed from the others'.", registry=r)
        self.attestations = Counter("lorafleet_proxy_attestations", "Replica attestation reports judged, by outcome "
                                    "(attested, disagrees).", ["outcome"], registry=r)
        self.attestation_disagreements = Counter("lorafleet_proxy_attestation_disagreements", "Replicas taken out of "
                                                 "routing because their engine attested other LoRA weights than the "
                                                 "ledger's reference.", registry=r)
        self.canary_undecided = Counter("lorafleet_proxy_canary_undecided", "Canary rounds where replicas disagreed "
                                        "and neither a majority nor a reference could tell which is right.", registry=r)
        self.canary_distance = Histogram(
            "lorafleet_proxy_canary_distance_nats", "Mean |difference| of log-probability per scored token between a "
            "replica's canary answer and the agreed one (the noise between healthy replicas, and what departs).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=r)
        self.canary_tolerance = Gauge(
            "lorafleet_proxy_canary_tolerance_nats", "The canary's tolerance in force, by precision: the setting, else "
            "ten times the noise measured between agreeing replicas (its floor and fixed bound in the docs).",
            ["precision"], registry=r)
        self.canary_rechecks = Counter("lorafleet_proxy_canary_rechecks", "Last ready holders of a subject whose "
                                       "canary answer departed, re-loaded in place and probed again instead of being "
                                       "taken out of routing.", registry=r)
        self.canary_rebaselines = Counter("lorafleet_proxy_canary_rebaselines", "Canary references renewed: a lone "
                                          "replica, re-loaded from the published files, still departed from an answer "
                                          "no replica gives any more.", registry=r)
        self.breaker_trips = Counter("lorafleet_proxy_breaker_trips", "Replicas taken out of routing by the circuit "
                                     "breaker (generations failing).", registry=r)
        self._paused_at: float | None = None
        self._answer_counts: dict[tuple[str, str], Any] = {}  # children of `answers`, looked up once each
        self._request_counts: dict[tuple[str, int], Any] = {}  # children of `requests`, looked up once each
        for op in BROADCAST_OPS:
            for outcome in BROADCAST_OUTCOMES:
                self.broadcasts.labels(op, outcome)
        for op in ROLLBACK_OPS:
            self.rollbacks.labels(op)
        for phase in LOAD_PHASES:
            self.load_phase_seconds.labels(phase)

    def count_request(self, route: str, status: int) -> None:
        """One request answered; `route` must come from a bounded set (known paths or "other")."""
        child = self._request_counts.get((route, status))
        if child is None:
            child = self._request_counts[route, status] = self.requests.labels(route, str(status))
        child.inc()

    def count_answer(self, replica: str, adapter: str) -> None:
        """One generation answered by `replica` with `adapter`'s weights (hot path: the child is looked up once)."""
        child = self._answer_counts.get((replica, adapter))
        if child is None:
            child = self._answer_counts[replica, adapter] = self.answers.labels(replica, adapter)
        child.inc()

    def forget_answers(self, *, replica: str | None = None, adapter: str | None = None) -> None:
        """Drop the answer series of a replica that left or an adapter that left the fleet (bounded labels)."""
        for key in [key for key in self._answer_counts if key[0] == replica or key[1] == adapter]:
            del self._answer_counts[key]
            self.answers.remove(*key)

    @contextlib.contextmanager
    def load_phase(self, phase: str) -> Iterator[None]:
        """Time one phase of an adapter load (LOAD_PHASES), whether it succeeds or not."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.load_phase_seconds.labels(phase).observe(time.perf_counter() - started)

    def broadcast_done(self, op: str, status: int, seconds: float) -> None:
        """One fleet-wide operation answered with HTTP `status` after `seconds`."""
        self.broadcast_seconds.labels(op).observe(seconds)
        outcome = "ok" if status < 400 else "rejected" if status < 500 else "failed"
        self.broadcasts.labels(op, outcome).inc()

    def track_pause(self, paused: bool) -> None:
        """Record the fleet's pause state after a broadcast; a pause -> resume transition observes the stall."""
        now = time.monotonic()
        if paused and self._paused_at is None:
            self._paused_at = now
        elif not paused and self._paused_at is not None:
            self.pause_seconds.observe(now - self._paused_at)
            self._paused_at = None
        self.paused.set(1 if paused else 0)
