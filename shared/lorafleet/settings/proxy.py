"""The proxy's section: its two ports, how it finds the replicas, routing, health, broadcasts, runs, the canary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lorafleet.adapters import content_dir
from lorafleet.settings.common import CommonSettings, ReplicaKey, check_urls, csv_items


class ProxySettings(CommonSettings, ReplicaKey):
    """Proxy: one vLLM server in front of the replicas."""

    proxy_upstreams: str = Field("", description="Comma-separated replica base URLs (static discovery).")
    proxy_upstream_dns: str = Field(
        "", description="host:port re-resolved every PROXY_DNS_INTERVAL_S; every address is a replica (Compose)."
    )
    proxy_fleet_host: str = Field(
        "127.0.0.1", description="Address the fleet port binds to: only an address the trainer's network reaches."
    )
    proxy_public_host: str = Field("127.0.0.1", description="Address the public port binds to.")
    proxy_port: int = Field(
        8000, ge=1, le=65535, description="Fleet port: internal network; no credentials but a named run's key "
        "(RUN_KEYS_DIR).",
    )
    proxy_public_port: int = Field(
        8080, ge=1, le=65535, description="Public port; needs PROXY_API_KEY, every request a Bearer key."
    )
    proxy_api_key: str = Field("", description="Bearer key of the public port. Empty = no public port. SECRET.")
    run_keys_dir: str = Field(
        "", description="Run keys: a directory of key hashes, one file per run (`lorafleet run-key NAME` writes "
        "them); set = a named run's routes on the fleet port need that run's Bearer key. Empty = off.",
    )
    proxy_routing: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="Rollout routing: KV-prefix affinity, or the least_loaded / round_robin baselines."
    )
    proxy_imbalance: int = Field(
        8, ge=0, description="Affinity yields to the least-loaded replica when it is this many requests ahead."
    )
    proxy_block_size: int = Field(
        0, ge=0, description="Routing block size in tokens; 0 = the replicas' KV block size (fallback 16)."
    )
    proxy_max_tracked_blocks: int = Field(
        200_000, ge=1000, description="Routing table cap (blocks); least recently used are forgotten first."
    )
    proxy_lora_load_timeout_s: float = Field(
        300.0, gt=0, description="Deadline for a fleet-wide adapter load (retries 'No adapter found')."
    )
    proxy_content_store: Path | None = Field(
        None, description="The content store: the folder only the proxy writes, where it copies every adapter it "
        "loads (one folder per content, named by its sha256) and from which the replicas load it, read-only. "
        "Unset: ADAPTER_ROOT/.content.",
    )
    proxy_content_grace_s: float = Field(
        120.0, ge=0, description="A content-store folder no ledger entry names any more is deleted once it was "
        "idle this long (a load in flight that reads it keeps it).",
    )
    proxy_adapter_max_mb: int = Field(
        4096, ge=1, description="The most one adapter's files may hold together (MiB); a load naming more, or a sparse "
        "or huge file, is refused with a 400 before any byte is copied into the content store.",
    )
    proxy_min_ready: int = Field(1, ge=1, description="Ready replicas needed for the proxy's /health to be 200.")
    proxy_health_interval_s: float = Field(2.0, gt=0, description="Seconds between health checks of each replica.")
    proxy_eject_after: int = Field(
        2, ge=1, description="Consecutive failed health checks (bad status, malformed answer) that eject a replica."
    )
    proxy_health_timeout_s: float = Field(5.0, gt=0, description="Timeout of one replica health check.")
    proxy_eject_slow_after_s: float = Field(
        30.0, gt=0, description="Health checks timing out for this long eject a replica (refused/reset: at once)."
    )
    proxy_sync_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait before retrying a replica whose catch-up sync keeps failing."
    )
    proxy_dns_interval_s: float = Field(5.0, gt=0, description="Seconds between DNS re-resolutions of replicas.")
    proxy_request_timeout_s: float = Field(
        900.0, gt=0, description="Read timeout of one routed request to a replica."
    )
    proxy_route_max_blocks: int = Field(
        64, ge=1, description="Routing hashes at most this many leading blocks of each prompt (bounds its cost)."
    )
    proxy_max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest request body the proxy accepts on any route (413 above)."
    )
    proxy_sync_pause: Literal["elide", "broadcast"] = Field(
        "elide",
        description="elide: a keep pause on the fleet port (trainer sync) pauses no replica; broadcast: it does.",
    )
    run_lease_s: float = Field(
        900.0, gt=0, description="A named run that sends nothing this long is expired: its adapters are unloaded "
        "fleet-wide and its LoRA slots returned.",
    )
    proxy_fair_inflight_per_replica: int = Field(
        64, ge=1, description="While several runs generate: requests in flight per ready replica, beyond which the "
        "proxy queues them by fair share (tokens per run weight); at most the engine's batch (--max-num-seqs).",
    )
    proxy_fair_pipeline_per_replica: int = Field(
        1, ge=0, description="While several runs generate: requests each replica gets beyond "
        "PROXY_FAIR_INFLIGHT_PER_REPLICA, waiting in its engine, so a batch slot that frees is refilled at once "
        "rather than an answer's round trip later (0 = none).",
    )
    proxy_canary_interval_s: float = Field(
        30.0, ge=0, description="Seconds between agreement-canary rounds (every ready replica probed for the base "
        "model and each run's newest adapter, answers compared); 0 = only at loads and re-syncs.",
    )
    proxy_attest_interval_s: float = Field(
        30.0, ge=0, description="Seconds between attestation rounds (every ready replica's engine reports the digests "
        "of the LoRA weights it holds, held to the ledger's references); 0 = only at loads and re-syncs.",
    )
    proxy_canary_tokens: int = Field(
        16, ge=4, le=64, description="Positions scored per canary probe of 16-bit replicas: word prefixes of its "
        "fixed text, one greedy token each (float32 replicas get one 4-token greedy continuation). More average more "
        "noise away and cost more per probe.",
    )
    proxy_canary_logprob_tolerance: float | None = Field(
        None, ge=0, description="Largest mean log-probability difference per scored token between two replicas' "
        "canary answers that still counts as the same weights. Unset: ten times the noise the proxy measures between "
        "replicas' answers, at least 0.002 and at most the dtype's fixed bound, 0.02 in float32 and 0.1 in bfloat16 "
        "or float16, which holds until it has measured any (docs/concepts/provenance.md#the-tolerance).",
    )
    proxy_canary_timeout_s: float = Field(
        60.0, gt=0, description="Timeout of one canary probe (a replica that does not answer in time has no vote).",
    )
    proxy_breaker_failures: int = Field(
        3, ge=1, description="Routed generations failing in a row (5xx, reset, timeout) that take a replica out of "
        "routing until it generates again (the circuit breaker).",
    )
    proxy_breaker_window: int = Field(
        20, ge=2, description="Routed generations per replica over which the breaker's failure rate is counted.",
    )
    proxy_breaker_failure_rate: float = Field(
        0.5, gt=0, le=1, description="Failed share of the last PROXY_BREAKER_WINDOW generations (once half of it "
        "is seen) that trips the breaker.",
    )

    @field_validator("proxy_upstreams")
    @classmethod
    def _upstreams_are_urls(cls, value: str) -> str:
        return check_urls(value)

    @field_validator("proxy_upstream_dns")
    @classmethod
    def _dns_is_host_port(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", value):
            raise ValueError("must be host:port, e.g. vllm:8000")
        return value

    @model_validator(mode="after")
    def _ports_differ(self) -> ProxySettings:
        if self.proxy_api_key and self.proxy_port == self.proxy_public_port:
            raise ValueError("PROXY_PORT and PROXY_PUBLIC_PORT must differ")
        return self

    @field_validator("proxy_content_store")
    @classmethod
    def _store_is_absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("must be an absolute path (replicas load its folders at the same path)")
        return value

    @property
    def content_store(self) -> Path:
        """PROXY_CONTENT_STORE, or its default ADAPTER_ROOT/.content."""
        return self.proxy_content_store or content_dir(self.adapter_root)

    @property
    def upstream_urls(self) -> list[str]:
        """Static replica URLs, without trailing slashes."""
        return [url.rstrip("/") for url in csv_items(self.proxy_upstreams)]
