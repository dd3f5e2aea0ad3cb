"""One replica as the proxy sees it: its membership state, its HTTP pool, and which adapters it holds.

Two views of its adapters, kept apart on purpose:
- `adapters` (name -> path) is the routing view: what requests may name on this replica. It is
  filled only when the replica becomes ready and emptied when it leaves traffic.
- `held` (name -> ledger entry, with the content fingerprint) is what the proxy knows the replica
  has loaded. It survives ejection, so a replica that missed a rebind (same name and path, new
  content) while it was out is recognised by its old fingerprint and reloaded before it is ready.
  A name the replica no longer lists is dropped from it (the replica restarted).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import httpx
from lorafleet.ledger_format import Entry
from lorafleet.vllm_api import ServerInfo, VLLMClient, replica_limits
from lorafleet.vllm_compat import Capabilities

# The parts of a replica's /server_info that GET /fleet repeats (system_env, a pip listing, is left out).
SERVER_INFO_KEPT = ("vllm_config", "vllm_env")
# How a replica failed a check or a routed call: refused (or reset: it died), timed out (it may only be busy), a bad
# status, a malformed answer. Each counts differently toward ejection (health.py).
Failure = Literal["refused", "timeout", "status", "malformed"]


@dataclass(frozen=True)
class Attestation:
    """What the replica's engine last attested (attestation.py): `state` is "unknown" (not asked yet), "attested",
    "disagrees" or "unattested" (it cannot attest); `digests` are the registered weights' digests per adapter name it
    held at `at` (monotonic); `trusted_at` is the wall time of its last report that agreed with the ledger (answers it
    gave after that, up to a disagreement, are flagged)."""

    state: str = "unknown"
    failure: str | None = None
    digests: dict[str, str] = field(default_factory=dict)
    at: float | None = None
    trusted_at: float | None = None

    def as_json(self) -> dict[str, object]:
        age = None if self.at is None else round(time.monotonic() - self.at, 1)
        return {"state": self.state, "failure": self.failure, "age_s": age, "trusted_at": self.trusted_at,
                "adapters": len(self.digests)}


class State(StrEnum):
    JOINING = "joining"
    SYNCING = "syncing"
    READY = "ready"
    EJECTED = "ejected"


def upstream_pool(transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """One connection pool per replica: httpx scans its whole pool for every request, so pools stay small."""
    limits = replica_limits(max_connections=None, max_keepalive_connections=512)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30.0, connect=5.0), limits=limits)


@dataclass(eq=False)
class Replica:
    url: str
    http: httpx.AsyncClient = field(repr=False)
    client: VLLMClient = field(repr=False)
    state: State = State.JOINING
    inflight: int = 0
    routed: int = 0
    engine_queue: int = 0  # vLLM's running + waiting requests at the last health check (other clients too)
    adapters: dict[str, str] = field(default_factory=dict)  # routing view, see the module docstring
    held: dict[str, Entry] = field(default_factory=dict)  # what it has loaded, with fingerprints
    last_error: str | None = None
    failures: int = 0  # consecutive failed checks (bad status, malformed answer)
    slow_since: float | None = None  # first of the current run of health-check timeouts (monotonic)
    sync_failures: int = 0  # consecutive failed syncs: the backoff before the next one doubles
    next_sync_at: float = 0.0
    info: ServerInfo | None = None
    vllm: Capabilities | None = None  # its vLLM version and routes, read at admission (None: not admitted yet)
    generates: bool | None = None  # the last warm-up completion succeeded (None: not tried yet); see admission.py
    sync_task: asyncio.Task[None] | None = field(default=None, repr=False)
    suspect: set[str] = field(default_factory=set)  # subjects the canary doubted: reloaded (cache reset) at catch-up
    canary_failure: str | None = None  # why the canary took it out of routing, until it agrees again
    served: dict[str, int] = field(default_factory=dict)  # generation answers per adapter (provenance)
    outcomes: deque[bool] = field(default_factory=deque, repr=False)  # the breaker's window: True = failed
    failing: int = 0  # routed generations failed in a row
    attestation: Attestation = field(default_factory=Attestation)  # what its engine last attested

    @property
    def load(self) -> int:
        return max(self.inflight, self.engine_queue)

    def observe(self, listed: dict[str, str]) -> None:
        """The replica listed these adapters (name -> path): forget what it no longer holds at that path."""
        for name in [name for name, entry in self.held.items() if listed.get(name) != entry.path]:
            del self.held[name]

    def holds(self, name: str, entry: Entry) -> bool:
        """Whether the replica holds exactly `entry` under `name` (an unknown fingerprint on either side trusts
        the path: after a proxy restart the ledger is the only record of what was loaded)."""
        known = self.held.get(name)
        if known is None or known.path != entry.path:
            return False
        return not (known.fingerprint and entry.fingerprint and known.fingerprint != entry.fingerprint)

    def as_json(self) -> dict[str, object]:
        """Its state, and its own view as last read (`server_info`: its /server_info JSON without the long
        `system_env`, None until read): the doctor sees a replica it cannot reach (internal network) so."""
        info = None if self.info is None else {k: v for k, v in self.info.raw.items() if k in SERVER_INFO_KEPT}
        return {"url": self.url, "state": self.state.value, "inflight": self.inflight, "routed": self.routed,
                "adapters": dict(self.adapters), "last_error": self.last_error, "generates": self.generates,
                "canary": {"agrees": self.canary_failure is None, "failure": self.canary_failure},
                "attestation": self.attestation.as_json(),
                "served": dict(self.served), "server_info": info,
                "vllm_version": self.vllm.version if self.vllm is not None else None}
