"""What the doctor observed and what it concludes: plain data, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from lorafleet.vllm_api import ServerInfo


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class CheckResult:
    """One row of the checklist. `fix` says what to change when the status is not PASS."""

    name: str
    status: Status
    reason: str
    fix: str = ""

    def as_json(self) -> dict[str, str]:
        return {**asdict(self), "status": self.status.value}


@dataclass
class ReplicaView:
    """One replica as it answers directly, or, when it cannot be reached directly (an internal network,
    vLLM's key), as the proxy last read it (`via_proxy`): the trainer's container sees replicas only so."""

    url: str
    proxy_state: str | None = None  # the proxy's word, only used to explain
    proxy_error: str | None = None
    proxy_generates: bool | None = None  # the proxy's warm-up verdict: False = /health 200 but cannot generate
    proxy_canary_failure: str | None = None  # the proxy's agreement canary: why its answers departed (None: agrees)
    # The proxy's attestation of its engine: "attested", "disagrees", "unattested" (cannot attest) or "unknown"
    # (None: an older proxy), and why when not attested.
    proxy_attestation: str | None = None
    proxy_attestation_failure: str | None = None
    inflight: int = 0  # requests the proxy has in flight to it (0 when not listed)
    vllm_version: str | None = None  # its GET /version, or the proxy's reading at admission (None: unknown)
    info: ServerInfo | None = None
    adapters: dict[str, str] | None = None  # name -> path from its own /v1/models
    error: str | None = None  # why it could not be read
    via_proxy: bool = False  # info and adapters are the proxy's last reading (GET /fleet), not its own answer
    proxy_server_info: dict[str, Any] | None = field(default=None, repr=False)  # /fleet's copy of its /server_info
    proxy_adapters: dict[str, str] | None = field(default=None, repr=False)  # /fleet's adapters (name -> path)

    @property
    def label(self) -> str:
        """Its URL, saying when what is known of it came through the proxy."""
        return f"{self.url} (via the proxy)" if self.via_proxy else self.url

    @property
    def reachable(self) -> bool:
        return self.error is None and self.info is not None and self.adapters is not None


@dataclass
class Snapshot:
    """Everything the read-only checks need, gathered once."""

    fleet_url: str | None
    proxy_error: str | None = None  # None when the proxy answered /fleet and /server_info
    proxy_info: dict[str, Any] | None = None  # the proxy's /server_info?config_format=json (trainer's view)
    proxy_base_model: str | None = None  # /v1/models data[0].id through the proxy
    sync_pause: str | None = None  # the proxy's PROXY_SYNC_PAUSE as /fleet reports it; None when it does not
    named_runs: list[str] | None = None  # runs other than the default one in /fleet; None when unknown
    run_keys: list[str] | None = None  # runs with a key when the proxy has run keys; None when off or unknown
    fleet_token: str = field(default="", repr=False)  # the run's key (TRAINER_RUN_KEY_FILE) the fleet URL is asked with
    ledger: list[tuple[str, str]] | None = None  # (name, path) in load order; None when unknown
    ledger_source: str = ""
    ledger_sources: dict[str, str] = field(default_factory=dict)  # name -> the run folder it was published from
    replicas: list[ReplicaView] = field(default_factory=list)
    metrics_path: Path | None = None
    metrics_lines: list[str] | None = None  # None when the file does not exist
    metrics_age_s: float | None = None  # seconds since metrics.jsonl was last written

    def reachable(self) -> list[ReplicaView]:
        return [replica for replica in self.replicas if replica.reachable]

    def unreachable(self) -> list[ReplicaView]:
        return [replica for replica in self.replicas if not replica.reachable]


@dataclass
class ProbeReport:
    """What the probe saw on every replica. Empty dicts mean that step did not run."""

    name: str = ""
    path: str = ""
    served: str = ""  # its folder in the proxy's content store, which replicas list after a load through the proxy
    skipped: str = ""  # why no probe adapter was published (root not mounted, no base config, ...)
    broadcast: bool = False  # a proxy carried load/unload/pause/resume
    load_error: str | None = None  # the proxy's (or the direct) load answer when it failed
    listed_after_load: dict[str, bool] = field(default_factory=dict)  # url -> /v1/models lists name at path
    generate_error: dict[str, str | None] = field(default_factory=dict)  # url -> error or None
    direct_load_error: dict[str, str | None] = field(default_factory=dict)  # diagnosis when the broadcast failed
    unload_error: str | None = None
    listed_after_unload: dict[str, bool] = field(default_factory=dict)
    deleted: bool = False
    pause_error: str | None = None
    paused: dict[str, bool | str] = field(default_factory=dict)  # url -> is_paused after a wait pause (or error)
    resume_error: str | None = None
    paused_after_resume: dict[str, bool | str] = field(default_factory=dict)  # url -> is_paused after resume
    keep_error: str | None = None  # the trainer's own pause (keep mode), which the proxy may elide
    keep_paused: dict[str, bool | str] = field(default_factory=dict)  # url -> is_paused after the keep pause
    # step ("pause", "resume", "keep") -> the proxy's own pause state after it (GET /fleet "paused":
    # the mode in effect or None), read before and after the replicas; CHANGING when another client paused or resumed
    # the fleet throughout; absent when the proxy did not say. Another client's pause or resume between the doctor's
    # step and its look is then the proxy's state, which the replicas must match, not a broadcast that missed them.
    fleet_paused: dict[str, str | None] = field(default_factory=dict)


CHANGING = "changing"  # ProbeReport.fleet_paused: other clients paused or resumed the fleet while the doctor looked


def replica_names(replicas: Sequence[ReplicaView]) -> str:
    """The replicas' labels, for a check's one-line reason."""
    return ", ".join(replica.label for replica in replicas)


def not_checked(snapshot: Snapshot) -> str:
    """The tail of a reason that says which replicas a check could not see ("" when it saw every one)."""
    down = snapshot.unreachable()
    return f" Not checked (unreachable, see lora_enabled): {replica_names(down)}." if down else ""
