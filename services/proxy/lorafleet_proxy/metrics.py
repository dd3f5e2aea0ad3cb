"""The proxy's own Prometheus metrics, in a registry per app (tests build several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lorafleet_proxy_requests", "Requests served, by route and status.",
                                ["route", "status"], registry=r)
        self.upstream_latency = Histogram("lorafleet_proxy_upstream_latency_seconds",
                                          "Routed request time at the replica (until headers for streams).",
                                          ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_retries = Counter("lorafleet_proxy_upstream_retries",
                                        "Routed requests retried on another replica, by reason.", ["reason"],
                                        registry=r)
        self.router = Counter("lorafleet_proxy_router_decisions", "Routing decisions by outcome.", ["outcome"],
                              registry=r)
        self.tracked_blocks = Gauge("lorafleet_proxy_router_tracked_blocks", "Blocks in the routing table.",
                                    registry=r)
        self.broadcasts = Counter("lorafleet_proxy_broadcasts", "Fleet-wide operations by operation and outcome.",
                                  ["op", "outcome"], registry=r)
        self.broadcast_seconds = Histogram("lorafleet_proxy_broadcast_duration_seconds",
                                           "Duration of fleet-wide operations.", ["op"], buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.replicas = Gauge("lorafleet_proxy_replicas", "Replicas by membership state.", ["state"], registry=r)
        self.inflight = Gauge("lorafleet_proxy_replica_inflight", "Requests in flight per replica.", ["replica"],
                              registry=r)
        self.ledger_size = Gauge("lorafleet_proxy_ledger_adapters", "Adapters in the fleet ledger.", registry=r)
        self.ejections = Counter("lorafleet_proxy_ejections", "Replicas ejected after failed health checks.",
                                 registry=r)
        self.loop_errors = Counter("lorafleet_proxy_loop_errors", "Unexpected errors survived by the supervised "
                                   "loops (health, dns) and by replica syncs, by loop.", ["loop"], registry=r)
        self.check_failures = Counter("lorafleet_proxy_replica_check_failures", "Failed replica checks by kind "
                                      "(refused, timeout, status, malformed).", ["kind"], registry=r)
        self.ledger_rebuilds = Counter("lorafleet_proxy_ledger_rebuilds", "Ledgers rebuilt from the replicas because "
                                       "the ledger file was unusable.", registry=r)
        self.ledger_write_failures = Counter("lorafleet_proxy_ledger_write_failures", "Ledger writes that failed "
                                             "(the broadcast that needed them failed).", registry=r)
