"""`lorafleet doctor`: the preflight checklist of the reference deployment, answered live against the fleet.

Every answer is observed, none assumed: the proxy's `/server_info` and `/fleet` give the trainer's
view and the replica list, each replica is then asked DIRECTLY (its own `/server_info`, `/v1/models`,
`/is_paused`), and a probe adapter is written under the adapter root, loaded through the proxy and
generated with on every replica. The check functions are pure (snapshot in, `CheckResult` out) so
they are unit-tested on recorded payloads; `run_doctor` gathers the snapshot and runs the probe.

The probe changes the fleet for a few seconds (one extra adapter, a pause in `wait` mode): run the
doctor before training, as the trainer does, or pass `probe=False` on a fleet that is training.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from lorafleet.adapters import fleet_dir, lora_dir, policy_name, policy_version
from lorafleet.logs import log_event
from lorafleet.settings import Settings, round_lora_rank
from lorafleet.vllm_api import ServerInfo, VLLMClient, VLLMError

log = logging.getLogger("lorafleet.doctor")

PROBE_PREFIX = "lorafleet-doctor-probe"
LEDGER_FILE = "proxy-ledger.json"
RATIO_WARN = 0.01  # |ratio - 1| above this: WARN
RATIO_FAIL = 0.05  # |ratio - 1| above this: FAIL
PROBE_PROMPT = "the red fox"
REQUEST_TIMEOUT_S = 30.0
PROBE_GENERATE_TIMEOUT_S = 120.0


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


# --- what the doctor observed -------------------------------------------------------------------------


@dataclass
class ReplicaView:
    """One replica as it answers directly (not as the proxy reports it)."""

    url: str
    proxy_state: str | None = None  # the proxy's word, only used to explain
    proxy_error: str | None = None
    info: ServerInfo | None = None
    adapters: dict[str, str] | None = None  # name -> path from its own /v1/models
    error: str | None = None  # why it could not be read

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
    ledger: list[tuple[str, str]] | None = None  # (name, path) in load order; None when unknown
    ledger_source: str = ""
    replicas: list[ReplicaView] = field(default_factory=list)
    metrics_path: Path | None = None
    metrics_lines: list[str] | None = None  # None when the file does not exist

    def reachable(self) -> list[ReplicaView]:
        return [replica for replica in self.replicas if replica.reachable]

    def unreachable(self) -> list[ReplicaView]:
        return [replica for replica in self.replicas if not replica.reachable]


@dataclass
class ProbeReport:
    """What the probe saw on every replica. Empty dicts mean that step did not run."""

    name: str = ""
    path: str = ""
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
    paused: dict[str, bool | str] = field(default_factory=dict)  # url -> is_paused after pause (or error text)
    resume_error: str | None = None
    resumed: dict[str, bool | str] = field(default_factory=dict)  # url -> not is_paused after resume


# --- helpers ------------------------------------------------------------------------------------------


def _names(replicas: Sequence[ReplicaView]) -> str:
    return ", ".join(replica.url for replica in replicas)


def _not_checked(snapshot: Snapshot) -> str:
    down = snapshot.unreachable()
    return f" Not checked (unreachable, see lora_enabled): {_names(down)}." if down else ""


def _with_lora(snapshot: Snapshot) -> list[ReplicaView]:
    """The reachable replicas served with --enable-lora: the ones whose LoRA limits can be checked."""
    return [replica for replica in snapshot.reachable() if replica.info is not None and replica.info.lora is not None]


def _no_lora_skip(name: str, snapshot: Snapshot) -> CheckResult:
    return CheckResult(name, Status.SKIP, "no reachable replica with LoRA enabled" + _not_checked(snapshot),
                       "see lora_enabled")


def _norm(path: str) -> str:
    return os.path.normpath(path) if path else path


def adapter_rank(settings: Settings, peft_config: Any = None) -> int:
    """The rank vLLM must serve: PEFT's `r` raised by any `rank_pattern` entry, else LORA_RANK."""
    if peft_config is None:
        return settings.lora_rank
    return max([int(peft_config.r), *(int(value) for value in (peft_config.rank_pattern or {}).values())])


def build_lora_config(settings: Settings) -> Any:
    """The trainer's PEFT LoraConfig as the settings define it (rank, alpha, all-linear): the one the trainer uses."""
    from peft import LoraConfig

    return LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules="all-linear",
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


# --- the checks (pure) --------------------------------------------------------------------------------


def check_fleet(snapshot: Snapshot) -> CheckResult:
    """0. The proxy answers and lists its replicas; every listed replica is ready."""
    name = "fleet"
    if snapshot.proxy_error is not None:
        given = f" Replica checks ran on the {len(snapshot.replicas)} given replica(s)." if snapshot.replicas else ""
        return CheckResult(name, Status.FAIL,
                           f"proxy {snapshot.fleet_url} did not answer: {snapshot.proxy_error}.{given}",
                           "start the proxy (lorafleet-proxy / `make up`) or pass --url with the fleet port the "
                           "trainer uses (TRAINER_VLLM_URL)")
    listed = [r for r in snapshot.replicas if r.proxy_state is not None]
    if not listed:
        return CheckResult(name, Status.FAIL, f"proxy {snapshot.fleet_url} lists no replicas",
                           "set PROXY_UPSTREAMS or PROXY_UPSTREAM_DNS and start replicas (`make scale N=2`)")
    problems = [f"{r.url} is {r.proxy_state}" + (f" ({r.proxy_error})" if r.proxy_error else "")
                for r in listed if r.proxy_state != "ready"]
    unknown = [r for r in snapshot.replicas if r.proxy_state is None]
    if unknown:
        problems.append(f"the proxy does not list {_names(unknown)}: no traffic and no broadcasts reach it")
    if problems:
        return CheckResult(name, Status.WARN, f"{len(listed)} replica(s) behind {snapshot.fleet_url}; "
                           + "; ".join(problems), "see the replica's log and the proxy's (GET /fleet: state, "
                           "last_error); the proxy re-syncs a replica when it answers")
    return CheckResult(name, Status.PASS, f"proxy {snapshot.fleet_url} answers; {len(listed)} replica(s), all ready")


def check_lora_enabled(snapshot: Snapshot, settings: Settings) -> CheckResult:
    """1. Every replica serves the same base model with LoRA enabled and runtime loading on."""
    name = "lora_enabled"
    if not snapshot.replicas:
        return CheckResult(name, Status.SKIP, "no replica to check", "pass --replica URL or fix the proxy")
    problems, fixes = [], []
    # A replica the proxy itself holds back (joining, syncing, ejected) gets no traffic and is synced when it
    # comes up: check 0 reports it. Unreachable is a FAIL only for one the proxy routes to, or one given by hand.
    down = [r for r in snapshot.unreachable() if r.proxy_state in (None, "ready")]
    up = snapshot.reachable()
    if not up:
        down = snapshot.unreachable()
    if down:
        problems.append("unreachable: " + "; ".join(f"{r.url} ({r.error})" for r in down))
        fixes.append("start or fix the unreachable replica(s), or remove them from the proxy's upstreams")
    no_lora = [r for r in up if r.info is not None and r.info.lora is None]
    if no_lora:
        problems.append(f"served without --enable-lora (lora_config is null): {_names(no_lora)}")
        fixes.append("restart those replicas with lorafleet-replica, which always passes --enable-lora "
                     "(or add --enable-lora --max-lora-rank R --max-loras N to `vllm serve`)")
    no_runtime = [r for r in up if r.info is not None and not _env_flag(r.info, "VLLM_ALLOW_RUNTIME_LORA_UPDATING")]
    if no_runtime:
        problems.append(f"runtime LoRA loading is off (VLLM_ALLOW_RUNTIME_LORA_UPDATING): {_names(no_runtime)}")
        fixes.append("set VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in those replicas' environment")
    models = {r.info.model for r in up if r.info is not None}
    if len(models) > 1:
        per = "; ".join(f"{r.url} serves {r.info.model}" for r in up if r.info is not None)
        problems.append(f"replicas serve different base models: {per}")
        fixes.append("serve one BASE_MODEL on every replica")
    elif models and settings.base_model not in models:
        problems.append(f"replicas serve {models.pop()} but BASE_MODEL is {settings.base_model}")
        fixes.append("use the same BASE_MODEL for trainer and replicas (one .env)")
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems), "; ".join(fixes))
    return CheckResult(name, Status.PASS, f"{len(up)} replica(s) serve {settings.base_model} with LoRA enabled "
                       "and runtime loading on")


def _env_flag(info: ServerInfo, variable: str) -> bool:
    env = info.raw.get("vllm_env")
    if not isinstance(env, dict):
        return True  # older vLLM without vllm_env: not observable here, the probe load tells
    return str(env.get(variable, "")).strip().lower() in ("1", "true")


def check_rank(snapshot: Snapshot, settings: Settings, peft_config: Any = None) -> CheckResult:
    """2. The adapter rank is at or below every replica's --max-lora-rank."""
    name = "lora_rank"
    rank = adapter_rank(settings, peft_config)
    with_lora = _with_lora(snapshot)
    if not with_lora:
        return _no_lora_skip(name, snapshot)
    low = [r for r in with_lora if r.info is not None and r.info.lora is not None and r.info.lora.max_lora_rank < rank]
    if low:
        per = ", ".join(f"{r.url} has --max-lora-rank {r.info.lora.max_lora_rank}" for r in low  # type: ignore[union-attr]
                        if r.info is not None)
        return CheckResult(name, Status.FAIL, f"adapter rank {rank} (LORA_RANK) is above the replicas' limit: {per}",
                           f"restart the replicas with --max-lora-rank {round_lora_rank(rank)} (lorafleet-replica "
                           f"derives it from LORA_RANK={rank}), or lower LORA_RANK")
    ranks = sorted({r.info.lora.max_lora_rank for r in with_lora if r.info and r.info.lora})
    status = Status.WARN if snapshot.unreachable() else Status.PASS
    return CheckResult(name, status, f"adapter rank {rank} <= --max-lora-rank {'/'.join(map(str, ranks))} on "
                       f"{len(with_lora)} replica(s).{_not_checked(snapshot)}".rstrip("."),
                       "see lora_enabled" if status is Status.WARN else "")


def check_adapter_sync(snapshot: Snapshot, settings: Settings, peft_config: Any = None) -> CheckResult:
    """3. TRL will choose adapter-only sync against the proxy: its own `select_adapter_sync` decides.

    It is fed the proxy's `/server_info` (what the trainer reads: lora_config MIN over replicas, dp=1)
    and the trainer's LoraConfig (built from the settings when not given). TRL raises for too low a
    rank or too few slots and warns, then falls back to merged-weight sync, for the rest (no
    --enable-lora, dp > 1, DoRA, modules_to_save, bias, lm_head/embeddings targets).
    """
    name = "adapter_sync"
    if snapshot.proxy_info is None:
        return CheckResult(name, Status.SKIP, "no /server_info from the proxy: the trainer's view is unknown",
                           "see fleet")
    config = snapshot.proxy_info.get("vllm_config")
    if not isinstance(config, dict):
        return CheckResult(name, Status.FAIL, "the proxy's /server_info?config_format=json has no vllm_config dict",
                           "use the lorafleet proxy (or vLLM >= 0.31) as TRAINER_VLLM_URL")
    try:
        lora = peft_config if peft_config is not None else build_lora_config(settings)
        decided, warnings = trl_select_adapter_sync(config, lora, settings.max_staleness)
    except ImportError as exc:
        return CheckResult(name, Status.WARN, f"TRL/PEFT not importable here ({exc}): TRL's own decision could not "
                           "be evaluated", "run the doctor where the trainer runs (it has trl and peft)")
    except ValueError as exc:
        return CheckResult(name, Status.FAIL, f"TRL refuses to start: {exc}",
                           "see lora_rank and lora_slots for the replica(s) to restart")
    if not decided:
        return CheckResult(name, Status.FAIL, "TRL would fall back to merged-weight sync (it reaches one replica "
                           f"only behind a proxy): {' '.join(warnings) or 'no reason logged'}",
                           "follow TRL's message above; lorafleet needs adapter-only sync")
    dp = config.get("parallel_config", {}).get("data_parallel_size")
    return CheckResult(name, Status.PASS, f"TRL's select_adapter_sync chooses adapter-only sync (dp={dp}, "
                       f"r={lora.r}, no DoRA/modules_to_save/bias/lm_head)")


def trl_select_adapter_sync(
    server_config: dict[str, Any], lora_config: Any, max_staleness: int
) -> tuple[bool, list[str]]:
    """Run TRL's `select_adapter_sync` on `server_config`; return its decision and the warnings it logged.

    The model is a stand-in with the two attributes TRL reads (`active_adapters`, `peft_config`), so
    no weights are loaded. accelerate's logger needs an accelerate state, hence `PartialState()`.
    """
    from types import SimpleNamespace

    from accelerate import PartialState
    # lorafleet pins TRL 1.16, whose AsyncGRPOTrainer lives in trl.experimental: the warning tells us nothing.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import async_grpo_trainer

    PartialState()
    stand_in = SimpleNamespace(active_adapters=["default"], peft_config={"default": lora_config})
    warnings: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(re.sub(r"^\[RANK \d+\] ", "", record.getMessage()))  # accelerate's prefix

    trl_logger = logging.getLogger(async_grpo_trainer.__name__)
    collector = _Collect()
    trl_logger.addHandler(collector)
    try:
        decided = async_grpo_trainer.select_adapter_sync(server_config, stand_in,
                                                         SimpleNamespace(max_staleness=max_staleness))
    finally:
        trl_logger.removeHandler(collector)
    return bool(decided), warnings


def check_names(snapshot: Snapshot, exclude: frozenset[str] = frozenset()) -> CheckResult:
    """5. Names are immutable: no replica binds a name to another path than the ledger; no two names share a path."""
    name = "names_immutable"
    problems: list[str] = []
    warnings: list[str] = []
    ledger = {n: _norm(p) for n, p in (snapshot.ledger or []) if n not in exclude}
    problems += _shared_paths("the ledger", ledger)
    bound: dict[str, dict[str, list[str]]] = {}  # name -> path -> replicas
    for replica in snapshot.reachable():
        adapters = {n: _norm(p) for n, p in (replica.adapters or {}).items() if n not in exclude}
        problems += _shared_paths(replica.url, adapters)
        for adapter, path in adapters.items():
            bound.setdefault(adapter, {}).setdefault(path, []).append(replica.url)
            if adapter in ledger and ledger[adapter] != path:
                problems.append(f"{replica.url} has {adapter} at {path} but the ledger binds it to {ledger[adapter]}")
            elif snapshot.ledger is not None and adapter not in ledger:
                warnings.append(f"{replica.url} has {adapter} ({path}), which is not in the ledger")
    for adapter, paths in bound.items():
        if len(paths) > 1 and adapter not in ledger:
            where = "; ".join(f"{path} on {', '.join(urls)}" for path, urls in paths.items())
            problems.append(f"{adapter} is bound to different paths: {where}")
    count = len({n for r in snapshot.reachable() for n in (r.adapters or {}) if n not in exclude})
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "unload the re-bound name on the replicas named (POST /v1/unload_lora_adapter) and load "
                           "it again through the proxy; publish new weights under a NEW name (trl-policy-v<N+1>), "
                           "never reuse a name: vLLM keeps serving prefix-cache blocks of the old weights")
    if snapshot.ledger is None:
        return CheckResult(name, Status.WARN, f"no ledger (proxy unreachable, {snapshot.ledger_source or 'no file'}); "
                           f"{count} loaded name(s) agree across replicas", "see fleet")
    if warnings:
        return CheckResult(name, Status.WARN, "; ".join(warnings),
                           "load adapters through the proxy only (it keeps the ledger and re-syncs replicas)")
    return CheckResult(name, Status.PASS, f"{len(ledger)} ledger name(s), {count} loaded name(s): every name has one "
                       f"path everywhere and no path has two names.{_not_checked(snapshot)}".rstrip("."))


def _shared_paths(where: str, adapters: dict[str, str]) -> list[str]:
    by_path: dict[str, list[str]] = {}
    for adapter, path in adapters.items():
        by_path.setdefault(path, []).append(adapter)
    return [f"{where}: {' and '.join(sorted(names))} share the path {path}"
            for path, names in by_path.items() if len(names) > 1]


def check_slots(snapshot: Snapshot, settings: Settings) -> CheckResult:
    """6. --max-loras >= max_staleness + 2 on every replica."""
    name = "lora_slots"
    need = settings.max_staleness + 2
    with_lora = _with_lora(snapshot)
    if not with_lora:
        return _no_lora_skip(name, snapshot)
    few = [r for r in with_lora if r.info and r.info.lora and r.info.lora.max_loras < need]
    if few:
        per = ", ".join(f"{r.url} has --max-loras {r.info.lora.max_loras}" for r in few  # type: ignore[union-attr]
                        if r.info is not None)
        return CheckResult(name, Status.FAIL, f"too few LoRA slots: {per}; MAX_STALENESS={settings.max_staleness} "
                           f"needs max_staleness + 2 = {need} (vLLM silently evicts an in-flight version otherwise)",
                           f"restart those replicas with --max-loras {need} (lorafleet-replica derives it from "
                           f"MAX_STALENESS={settings.max_staleness}: give every service the same .env), or lower "
                           "MAX_STALENESS")
    slots = sorted({r.info.lora.max_loras for r in with_lora if r.info and r.info.lora})
    status = Status.WARN if snapshot.unreachable() else Status.PASS
    return CheckResult(name, status, f"--max-loras {'/'.join(map(str, slots))} >= {need} (MAX_STALENESS="
                       f"{settings.max_staleness} + 2) on {len(with_lora)} replica(s).{_not_checked(snapshot)}"
                       .rstrip("."), "see lora_enabled" if status is Status.WARN else "")


def check_versions_kept(snapshot: Snapshot, settings: Settings) -> CheckResult:
    """7. The newest max_staleness + 1 versions of the run are in the ledger and loaded on every replica.

    In-flight rollouts may still name any of them; an evicted one fails those rollouts (TRL retries
    4xx 30 times, then the whole run dies). A loaded version whose directory is gone kills the engine
    the next time vLLM re-reads it, so that is a failure too.
    """
    name = "versions_kept"
    if snapshot.ledger is None:
        return CheckResult(name, Status.SKIP, "no ledger (proxy unreachable)", "see fleet")
    run_lora = _norm(str(lora_dir(settings.adapter_root, settings.run_name)))
    versions = {policy_version(n): _norm(p) for n, p in snapshot.ledger if os.path.dirname(_norm(p)) == run_lora}
    versions.pop(None, None)
    if not versions:
        return CheckResult(name, Status.SKIP, f"no policy version of run {settings.run_name} published yet "
                           f"(nothing under {run_lora} in the ledger)")
    newest = max(v for v in versions if v is not None)
    window = range(max(1, newest - settings.max_staleness), newest + 1)
    problems = []
    missing = [v for v in window if v not in versions]
    if missing:
        problems.append(f"the ledger lacks {', '.join(f'v{v}' for v in missing)} of the window "
                        f"v{window.start}..v{newest} (MAX_STALENESS={settings.max_staleness})")
    for replica in snapshot.reachable():
        gone = [v for v in window if v in versions and (replica.adapters or {}).get(policy_name(v)) is None]
        if gone:
            problems.append(f"{replica.url} no longer has {', '.join(map(policy_name, gone))} loaded")
    if settings.adapter_root.is_dir():
        deleted = [policy_name(v) for v in window if v in versions
                   and not Path(versions[v], "adapter_config.json").is_file()]
        if deleted:
            problems.append(f"loaded but their directory is gone: {', '.join(deleted)} (vLLM's engine dies when it "
                            "re-reads an evicted adapter whose files were deleted)")
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "keep every version of the window loaded (load it again through the proxy), check "
                           "lora_slots and that trainer and proxy share MAX_STALENESS; delete a version's files only "
                           "after it was unloaded everywhere")
    status = Status.WARN if snapshot.unreachable() else Status.PASS
    return CheckResult(name, status, f"run {settings.run_name}: v{window.start}..v{newest} ({len(window)} version(s), "
                       f"max_staleness + 1 = {settings.max_staleness + 1} once published) in the ledger and loaded "
                       f"on {len(snapshot.reachable())} replica(s).{_not_checked(snapshot)}".rstrip("."),
                       "see lora_enabled" if status is Status.WARN else "")


def check_probe(report: ProbeReport, snapshot: Snapshot, settings: Settings) -> CheckResult:
    """4. Every replica reads the adapter root at the same path: the probe was loaded and generated everywhere."""
    name = "adapter_root"
    if report.skipped:
        return CheckResult(name, Status.SKIP, report.skipped, _skip_fix(report.skipped))
    root = settings.adapter_root
    refused = {url: error for url, error in report.direct_load_error.items() if error}
    blind = {url: error for url, error in refused.items() if "No adapter found" in error}
    failed_gen = {url: error for url, error in report.generate_error.items() if error and url not in refused}
    not_listed = [url for url, ok in report.listed_after_load.items() if not ok]
    problems = [f"{url} cannot read {report.path}: {error}" if url in blind else
                f"{url} refused the probe adapter: {error}" for url, error in refused.items()]
    if not refused and report.load_error:
        problems.append(f"loading the probe {report.name} from {report.path} failed: {report.load_error}")
    problems += [f"{url} did not generate with the probe: {error}" for url, error in failed_gen.items()]
    if not problems and not_listed:
        problems.append(f"the probe is not in /v1/models of {', '.join(not_listed)} after the load")
    if blind:
        fix = (f"mount the adapter volume at ADAPTER_ROOT={root} (the same absolute path) in every replica, "
               f"readable by its user: {', '.join(blind)} cannot see it")
    else:
        fix = "see lora_enabled and the replica's log for the refused load or generation"
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems), fix)
    where = "through the proxy" if report.broadcast else "directly"
    seen = f"probe adapter under {root} loaded {where} and generated with on all {len(report.generate_error)} " \
           f"replica(s)"
    if not report.deleted:
        return CheckResult(name, Status.WARN, f"{seen}, but its files stay at {report.path}: a replica still holds "
                           f"{report.name} (see broadcasts)", f"unload {report.name} there, then delete the directory")
    return CheckResult(name, Status.PASS, f"{seen}, then unloaded and deleted.{_not_checked(snapshot)}".rstrip("."))


def _skip_fix(reason: str) -> str:
    if " here" in reason:
        return ("run the doctor where the trainer runs, with ADAPTER_ROOT mounted read-write "
                "(e.g. `docker compose run --rm trainer lorafleet doctor`)")
    return ""


def check_broadcasts(report: ProbeReport, snapshot: Snapshot) -> CheckResult:
    """8. Load, unload, pause and resume through the proxy reached every replica (seen on each replica)."""
    name = "broadcasts"
    if not report.broadcast:
        return CheckResult(name, Status.SKIP, report.skipped or "no proxy to broadcast through", "see fleet")
    problems = []
    if report.path:
        if report.load_error is None:
            problems += [f"load did not reach {url}" for url, ok in report.listed_after_load.items() if not ok]
        if report.unload_error:
            problems.append(f"unload through the proxy failed: {report.unload_error}")
        problems += [f"unload did not reach {url}" for url, ok in report.listed_after_unload.items() if not ok]
    if report.pause_error:
        problems.append(f"pause through the proxy failed: {report.pause_error}")
    problems += [f"pause did not reach {url} (is_paused: {state})" for url, state in report.paused.items()
                 if state is not True]
    if report.resume_error:
        problems.append(f"resume through the proxy failed: {report.resume_error}")
    problems += [f"resume did not reach {url} ({state})" for url, state in report.resumed.items() if state is not True]
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "the proxy must broadcast to every replica: check its log for that replica (state, "
                           "last_error in GET /fleet); a replica it does not know gets no broadcasts")
    if not report.path or report.load_error is not None:
        why = report.skipped or "the probe load failed"
        return CheckResult(name, Status.WARN, f"pause, resume reached all {len(report.paused)} replica(s); load and "
                           f"unload were not observed: {why}", "see adapter_root")
    return CheckResult(name, Status.PASS, f"load, unload, pause, resume through the proxy observed on all "
                       f"{len(report.paused)} replica(s)")


def check_ratio(snapshot: Snapshot) -> CheckResult:
    """9. The trainer/server importance ratio of the current run stays near 1 (latest logged `ratio`)."""
    name = "ratio"
    if snapshot.metrics_lines is None:
        return CheckResult(name, Status.SKIP, f"no {snapshot.metrics_path} yet: no run has logged")
    ratios = []
    for line in snapshot.metrics_lines:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            value = float(json.loads(line).get("ratio"))
            if math.isfinite(value):
                ratios.append(value)
    if not ratios:
        return CheckResult(name, Status.SKIP, f"{snapshot.metrics_path} has no `ratio` yet")
    latest, recent = ratios[-1], ratios[-20:]
    spread = (f"latest ratio {latest:.4f} (last {len(recent)}: {min(recent):.4f}..{max(recent):.4f}) "
              f"in {snapshot.metrics_path}")
    fix = ("trainer and replicas must compute the same logprobs: same weights and dtype (VLLM_DTYPE=float32 with fp32 "
           "training, or bf16 on both), --logprobs-mode processed_logprobs, no stale adapter under a reused name")
    if abs(latest - 1) > RATIO_FAIL:
        return CheckResult(name, Status.FAIL, f"{spread} is outside [{1 - RATIO_FAIL}, {1 + RATIO_FAIL}]", fix)
    if abs(latest - 1) > RATIO_WARN:
        return CheckResult(name, Status.WARN, f"{spread} is outside [{1 - RATIO_WARN}, {1 + RATIO_WARN}]", fix)
    return CheckResult(name, Status.PASS, spread)


# --- gathering ----------------------------------------------------------------------------------------


def _client(url: str, token: str = "", http: httpx.AsyncClient | None = None) -> VLLMClient:
    return VLLMClient(url, token=token, timeout=REQUEST_TIMEOUT_S, client=http)


async def _read_replica(replica: ReplicaView, token: str, http: httpx.AsyncClient | None) -> None:
    async with _client(replica.url, token, http) as client:
        try:
            replica.info = await client.server_info()
            replica.adapters = await client.loaded_adapters()
        except (VLLMError, ValueError, KeyError) as exc:
            replica.error = str(exc)


async def gather_snapshot(settings: Settings, fleet_url: str | None, replica_urls: Sequence[str] = (),
                          http: httpx.AsyncClient | None = None) -> Snapshot:
    """Read the proxy's view (/fleet, /server_info, /v1/models) and each replica's own, concurrently."""
    snapshot = Snapshot(fleet_url=fleet_url.rstrip("/") if fleet_url else None)
    views: dict[str, ReplicaView] = {}
    if snapshot.fleet_url:
        async with _client(snapshot.fleet_url, http=http) as proxy:
            try:
                fleet = (await proxy.request("GET", "/fleet")).json()
                for item in fleet.get("replicas", []):
                    url = str(item["url"]).rstrip("/")
                    views[url] = ReplicaView(url, item.get("state"), item.get("last_error"))
                snapshot.ledger = [(str(e["name"]), str(e["path"])) for e in fleet.get("ledger", [])]
                snapshot.ledger_source = f"{snapshot.fleet_url}/fleet"
                snapshot.proxy_info = (await proxy.request("GET", "/server_info",
                                                           params={"config_format": "json"})).json()
                cards = await proxy.models()
                snapshot.proxy_base_model = cards[0].id if cards else None
            except (VLLMError, ValueError, KeyError, TypeError) as exc:
                snapshot.proxy_error = str(exc)
    else:
        snapshot.proxy_error = "no fleet URL given"
    for url in replica_urls:
        views.setdefault(url.rstrip("/"), ReplicaView(url.rstrip("/")))
    snapshot.replicas = list(views.values())
    if snapshot.ledger is None:
        snapshot.ledger, snapshot.ledger_source = _ledger_file(settings.adapter_root)
    token = settings.proxy_upstream_token
    await asyncio.gather(*(_read_replica(replica, token, http) for replica in snapshot.replicas))
    snapshot.metrics_path = settings.metrics_path
    with contextlib.suppress(OSError):
        snapshot.metrics_lines = snapshot.metrics_path.read_text().splitlines()
    return snapshot


def _ledger_file(root: Path) -> tuple[list[tuple[str, str]] | None, str]:
    """The proxy's persisted ledger, when the proxy cannot be asked and the fleet volume is mounted here."""
    path = fleet_dir(root) / LEDGER_FILE
    try:
        payload = json.loads(path.read_text())
        return [(str(e["name"]), str(e["path"])) for e in payload["adapters"]], str(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"no readable {path}"


# --- the probe ----------------------------------------------------------------------------------------


def base_model_config(candidates: Sequence[str]) -> dict[str, Any]:
    """config.json of the served base model: a local directory, else the Hugging Face cache (or Hub)."""
    for candidate in candidates:
        path = Path(candidate, "config.json")
        if path.is_file():
            return json.loads(path.read_text())
    errors = []
    for candidate in candidates:
        if Path(candidate).is_absolute():
            continue
        try:
            from huggingface_hub import hf_hub_download

            return json.loads(Path(hf_hub_download(candidate, "config.json")).read_text())
        except Exception as exc:  # any Hub/cache failure: try the next candidate, report all
            errors.append(f"{candidate}: {type(exc).__name__}: {exc}")
    raise FileNotFoundError("no config.json for the base model (" + "; ".join(errors or list(candidates)) + ")")


def write_probe_adapter(out: Path, config: dict[str, Any], base_model: str, seed: int = 0) -> Path:
    """A minimal real PEFT LoRA adapter: rank 1 on layer 0's q_proj, shapes from the model config, no weights read.

    Cheap for any size of model (a few KB). vLLM accepts a subset of its LoRA target modules, so
    q_proj alone loads on every Llama/Qwen/Mistral-style model. Published like TRL publishes: staged
    under a dot-name, then renamed into place.
    """
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    rng = _lcg(seed)
    tensors = {
        f"{module}.lora_A.weight": ([1, hidden], [next(rng) for _ in range(hidden)]),
        f"{module}.lora_B.weight": ([heads * head_dim, 1], [next(rng) for _ in range(heads * head_dim)]),
    }
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": 1,
        "lora_alpha": 1, "lora_dropout": 0.0, "target_modules": ["q_proj"], "bias": "none",
        "modules_to_save": None, "use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
        "inference_mode": True,
    }
    stage = out.parent / f".{out.name}.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    (stage / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    (stage / "adapter_model.safetensors").write_bytes(_safetensors_f32(tensors))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(stage, out)
    return out


def _lcg(seed: int) -> Iterator[float]:
    """Small deterministic non-zero values in [-0.05, 0.05] without numpy or torch."""
    state = seed * 2654435761 + 1
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        yield ((state >> 33) / 2**31 - 0.5) / 10


def _safetensors_f32(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """The safetensors format: u64 header length, JSON header (8-byte aligned), raw little-endian data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs)


async def _listed(client: VLLMClient, name: str, path: str) -> bool | str:
    try:
        return _norm((await client.loaded_adapters()).get(name, "")) == _norm(path)
    except VLLMError as exc:
        return str(exc)


async def _paused(client: VLLMClient) -> bool | str:
    try:
        return await client.is_paused()
    except VLLMError as exc:
        return str(exc)


async def _generate(client: VLLMClient, name: str) -> str | None:
    body = {"model": name, "prompt": PROBE_PROMPT, "max_tokens": 2, "temperature": 0.0}
    try:
        answer = await client.completions(body, timeout=PROBE_GENERATE_TIMEOUT_S)
    except VLLMError as exc:
        return str(exc)
    return None if answer.get("choices") else f"no choices in {answer}"


async def run_probe(settings: Settings, snapshot: Snapshot, http: httpx.AsyncClient | None = None) -> ProbeReport:
    """Publish a probe adapter, load it (through the proxy when there is one), generate with it on every
    replica directly, unload and delete it; then pause and resume through the proxy. Always cleans up."""
    report = ProbeReport(broadcast=snapshot.proxy_error is None)
    replicas = snapshot.reachable()  # the unreachable ones already fail lora_enabled
    if not replicas:
        report.skipped = "no reachable replica to probe"
        return report
    token = settings.proxy_upstream_token
    clients = {r.url: _client(r.url, token, http) for r in replicas}
    proxy = _client(snapshot.fleet_url, http=http) if report.broadcast and snapshot.fleet_url else None
    try:
        await _probe_adapter(settings, snapshot, report, clients, proxy)
        if proxy is not None:
            await _probe_pause(report, clients, proxy)
    finally:
        for client in clients.values():
            await client.aclose()
        if proxy is not None:
            await proxy.aclose()
    return report


async def _probe_adapter(settings: Settings, snapshot: Snapshot, report: ProbeReport,
                         clients: dict[str, VLLMClient], proxy: VLLMClient | None) -> None:
    root = settings.adapter_root
    if not root.is_dir():
        report.skipped = f"ADAPTER_ROOT {root} is not a directory here: the probe adapter cannot be published"
        return
    served = [r.info.model for r in snapshot.reachable() if r.info is not None]
    base = snapshot.proxy_base_model or (served[0] if served else settings.base_model)
    try:
        config = base_model_config(list(dict.fromkeys([base, settings.base_model])))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        report.skipped = f"cannot build the probe adapter: {exc}"
        return
    report.name = f"{PROBE_PREFIX}-{secrets.token_hex(4)}"
    directory = lora_dir(root, settings.run_name) / report.name
    try:
        write_probe_adapter(directory, config, base)
    except (OSError, KeyError, ValueError) as exc:
        report.skipped = f"cannot write the probe adapter under {root} here: {exc}"
        return
    report.path = str(directory.resolve())
    log_event(log, "probe_published", name=report.name, path=report.path)
    try:
        await _probe_load_and_generate(report, clients, proxy)
    finally:
        still = await _probe_unload(report, clients, proxy)
        if still:
            # Deleting files of a registered adapter kills vLLM's engine when it re-reads them: keep them.
            log_event(log, "probe_kept", logging.WARNING, path=report.path, replicas=",".join(still))
        else:
            shutil.rmtree(directory, ignore_errors=True)
            report.deleted = not directory.exists()


async def _probe_load_and_generate(report: ProbeReport, clients: dict[str, VLLMClient],
                                   proxy: VLLMClient | None) -> None:
    try:
        if proxy is not None:
            await proxy.load_lora_adapter(report.name, report.path)
        else:
            results = await asyncio.gather(*(c.load_lora_adapter(report.name, report.path) for c in clients.values()),
                                           return_exceptions=True)
            report.direct_load_error = {url: str(r) if isinstance(r, BaseException) else None
                                        for url, r in zip(clients, results, strict=True)}
            if any(report.direct_load_error.values()):
                report.load_error = "direct load failed on some replicas"
    except VLLMError as exc:
        report.load_error = str(exc)
        log_event(log, "probe_load_failed", logging.WARNING, name=report.name, error=exc)
        # Which replica cannot read it? Ask each one directly (unloaded again in _probe_unload).
        results = await asyncio.gather(*(c.load_lora_adapter(report.name, report.path) for c in clients.values()),
                                       return_exceptions=True)
        report.direct_load_error = {url: (None if not isinstance(r, BaseException) or
                                          (isinstance(r, VLLMError) and r.already_loaded) else str(r))
                                    for url, r in zip(clients, results, strict=True)}
    listed = await asyncio.gather(*(_listed(c, report.name, report.path) for c in clients.values()))
    report.listed_after_load = {url: state is True for url, state in zip(clients, listed, strict=True)}
    generated = await asyncio.gather(*(_generate(c, report.name) for c in clients.values()))
    report.generate_error = dict(zip(clients, generated, strict=True))
    log_event(log, "probe_generated", name=report.name,
              failed=",".join(url for url, error in report.generate_error.items() if error) or "none")


async def _probe_unload(report: ProbeReport, clients: dict[str, VLLMClient], proxy: VLLMClient | None) -> list[str]:
    """Unload the probe (through the proxy), observe each replica, then unload directly what is left.

    Returns the replicas that still hold the probe (its files must then stay)."""
    if proxy is not None:
        try:
            await proxy.unload_lora_adapter(report.name)
        except VLLMError as exc:
            if not (exc.status == 404 and report.load_error):  # 404 after a failed load: nothing was loaded
                report.unload_error = str(exc)
        listed = await asyncio.gather(*(_listed(c, report.name, report.path) for c in clients.values()))
        report.listed_after_unload = {url: state is not True for url, state in zip(clients, listed, strict=True)}
    still = []
    for url, client in clients.items():
        try:
            await client.unload_lora_adapter(report.name)
        except VLLMError as exc:
            if exc.status != 404:
                still.append(url)
    return still


async def _probe_pause(report: ProbeReport, clients: dict[str, VLLMClient], proxy: VLLMClient) -> None:
    """Pause and resume through the proxy. `wait` (in-flight requests finish, none is lost): the proxy always
    broadcasts it, while the trainer's `keep` pauses may be elided (PROXY_SYNC_PAUSE)."""
    try:
        try:
            await proxy.pause("wait")
        except VLLMError as exc:
            report.pause_error = str(exc)
        report.paused = dict(zip(clients, await asyncio.gather(*(_paused(c) for c in clients.values())), strict=True))
    finally:
        try:
            await proxy.resume()
        except VLLMError as exc:
            report.resume_error = str(exc)
        after = await asyncio.gather(*(_paused(c) for c in clients.values()))
        report.resumed = {url: (not state) if isinstance(state, bool) else state
                          for url, state in zip(clients, after, strict=True)}
        for url, state in report.resumed.items():
            if state is not True:  # never leave a replica paused behind the doctor
                with contextlib.suppress(VLLMError):
                    await clients[url].resume()
                log_event(log, "probe_resumed_directly", logging.WARNING, replica=url)


# --- the runner ---------------------------------------------------------------------------------------


def evaluate(snapshot: Snapshot, settings: Settings, probe: ProbeReport, peft_config: Any = None) -> list[CheckResult]:
    """All checks, in the checklist's order, from what was observed."""
    exclude = frozenset({probe.name}) if probe.name else frozenset()
    return [
        check_fleet(snapshot),
        check_lora_enabled(snapshot, settings),
        check_rank(snapshot, settings, peft_config),
        check_adapter_sync(snapshot, settings, peft_config),
        check_probe(probe, snapshot, settings),
        check_names(snapshot, exclude),
        check_slots(snapshot, settings),
        check_versions_kept(snapshot, settings),
        check_broadcasts(probe, snapshot),
        check_ratio(snapshot),
    ]


async def run_doctor(settings: Settings, fleet_url: str | None = None, *, replicas: Sequence[str] = (),
                     probe: bool = True, peft_config: Any = None,
                     http: httpx.AsyncClient | None = None) -> list[CheckResult]:
    """Run the checklist against the fleet behind `fleet_url` (default TRAINER_VLLM_URL) and/or `replicas`.

    `peft_config` is the trainer's LoraConfig (built from the settings when None). `probe=False`
    skips the two checks that change the fleet (adapter_root, broadcasts). `http` replaces the HTTP
    client (tests serve recorded payloads through it).
    """
    url = settings.trainer_vllm_url if fleet_url is None else fleet_url
    snapshot = await gather_snapshot(settings, url, replicas, http)
    report = await run_probe(settings, snapshot, http) if probe else ProbeReport(skipped="probe disabled (--no-probe)")
    results = evaluate(snapshot, settings, report, peft_config)
    for result in results:
        log_event(log, "doctor_check", check=result.name, status=result.status.value, reason=result.reason)
    return results


def run_doctor_sync(settings: Settings, fleet_url: str | None = None, **kwargs: Any) -> list[CheckResult]:
    """`run_doctor` for synchronous callers (the CLI, the trainer before it starts its own loop)."""
    return asyncio.run(run_doctor(settings, fleet_url, **kwargs))


def failed(results: Sequence[CheckResult]) -> list[CheckResult]:
    return [result for result in results if result.status is Status.FAIL]


def render_table(results: Sequence[CheckResult], width: int = 100) -> str:
    """A fixed-width table: number, check, status, reason, and the fix on its own line when not PASS."""
    name_w = max(len(r.name) for r in results)
    indent = 4 + name_w + 2 + 4 + 2
    wrap = max(width - indent, 40)
    lines = [f"{'#':>2}  {'CHECK':<{name_w}}  {'STAT':<4}  DETAIL"]
    for number, result in enumerate(results):
        reason = _wrap(result.reason, wrap) or [""]
        lines.append(f"{number:>2}  {result.name:<{name_w}}  {result.status.value:<4}  {reason[0]}")
        lines += [" " * indent + more for more in reason[1:]]
        if result.fix and result.status is not Status.PASS:
            lines += [" " * indent + text for text in _wrap("fix: " + result.fix, wrap)]
    counts = {status: sum(r.status is status for r in results) for status in Status}
    lines.append(", ".join(f"{count} {status.value}" for status, count in counts.items() if count))
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    """Wrap at spaces only: paths, URLs and flags stay whole (copy-pasteable) even when longer than a line."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)
