"""The doctor's checks: pure functions of what was observed (a Snapshot, a ProbeReport) to a CheckResult.

No I/O here beyond asking whether a run's adapter directory still exists, so every check is
unit-tested on recorded payloads. The numbers in the docstrings are the checklist's order.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet.adapters import lora_dir, policy_version
from lorafleet.lora import adapter_rank, build_lora_config, trl_select_adapter_sync
from lorafleet.ratio_outliers import METRICS_KEY, RATIO_FAIL, RATIO_WARN, outliers, read_rows
from lorafleet.runs import run_of
from lorafleet.settings import StackSettings, gpus_shared, round_lora_rank
from lorafleet.vllm_api import ServerInfo
from lorafleet.vllm_compat import SUPPORTED, standing

from lorafleet_ops.commands.doctor.model import (
    CheckResult,
    ProbeReport,
    ReplicaView,
    Snapshot,
    Status,
    not_checked,
    replica_names,
)
from lorafleet_ops.commands.doctor.probe_checks import check_broadcasts, check_probe


def _with_lora(snapshot: Snapshot) -> list[ReplicaView]:
    """The reachable replicas served with --enable-lora: the ones whose LoRA limits can be checked."""
    return [replica for replica in snapshot.reachable() if replica.info is not None and replica.info.lora is not None]


def _no_lora_skip(name: str, snapshot: Snapshot) -> CheckResult:
    return CheckResult(name, Status.SKIP, "no reachable replica with LoRA enabled" + not_checked(snapshot),
                       "see lora_enabled")


def norm_path(path: str) -> str:
    """A path as vLLM and the ledger may spell it differently (trailing slash, `..`): normalised, "" kept."""
    return os.path.normpath(path) if path else path



# Why the proxy took a replica out of routing for its weights: (its reason, what it means, the fix).
WEIGHT_DOUBTS: list[tuple[Callable[[ReplicaView], str | None], str, str]] = [
    (lambda r: r.proxy_canary_failure,
     "decodes with other weights than its peers (the proxy's agreement canary took it out of routing): ",
     "the proxy re-syncs it (adapter reloaded, prefix cache reset) and re-admits it once it agrees; if it keeps "
     "departing, restart that replica and report the engine's version"),
    (lambda r: r.proxy_attestation_failure if r.proxy_attestation == "disagrees" else None,
     "its engine attests other LoRA weights than the ledger's reference (the proxy took it out of routing): ",
     "the proxy re-syncs it (adapter reloaded) and re-admits it once it attests correctly; if it keeps disagreeing, "
     "restart that replica and report the engine's version"),
]


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
    mute = [r for r in listed if r.proxy_generates is False]
    if mute:
        return CheckResult(name, Status.FAIL, "answers /health but cannot generate (the proxy's one-token warm-up "
                           "failed; it gets no traffic): " + "; ".join(f"{r.url}: {r.proxy_error}" for r in mute),
                           "read that replica's log for the engine's error (on CPU: a C++ compiler and Python's "
                           "headers must be in the image); the proxy admits it once a warm-up succeeds")
    for failure, what, fix in WEIGHT_DOUBTS:
        doubted = [(r, failure(r)) for r in listed if failure(r)]
        if doubted:
            return CheckResult(name, Status.FAIL, what + "; ".join(f"{r.url}: {why}" for r, why in doubted), fix)
    problems = [f"{r.url} is {r.proxy_state}" + (f" ({r.proxy_error})" if r.proxy_error else "")
                for r in listed if r.proxy_state != "ready"]
    problems += [f"{r.url} is unattested, its engine's LoRA weights unverified ({r.proxy_attestation_failure})"
                 for r in listed if r.proxy_attestation == "unattested"]
    unknown = [r for r in snapshot.replicas if r.proxy_state is None]
    if unknown:
        problems.append(f"the proxy does not list {replica_names(unknown)}: no traffic and no broadcasts reach it")
    if problems:
        return CheckResult(name, Status.WARN, f"{len(listed)} replica(s) behind {snapshot.fleet_url}; "
                           + "; ".join(problems), "see the replica's log and the proxy's (GET /fleet: state, "
                           "last_error); the proxy re-syncs a replica when it answers")
    return CheckResult(name, Status.PASS, f"proxy {snapshot.fleet_url} answers; {len(listed)} replica(s), all ready")


def check_lora_enabled(snapshot: Snapshot, settings: StackSettings) -> CheckResult:
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
        problems.append(f"served without --enable-lora (lora_config is null): {replica_names(no_lora)}")
        fixes.append("restart those replicas with lorafleet-replica, which always passes --enable-lora "
                     "(or add --enable-lora --max-lora-rank R --max-loras N to `vllm serve`)")
    runtime = {r.url: _env_flag(r.info, "VLLM_ALLOW_RUNTIME_LORA_UPDATING") for r in up if r.info is not None}
    no_runtime = [r for r in up if runtime.get(r.url) is False]
    unknown = [r for r in up if r.url in runtime and runtime[r.url] is None]
    if no_runtime:
        problems.append(f"runtime LoRA loading is off (VLLM_ALLOW_RUNTIME_LORA_UPDATING): {replica_names(no_runtime)}")
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
    if unknown:
        return CheckResult(name, Status.WARN, f"{len(up)} replica(s) serve {settings.base_model} with LoRA enabled; "
                           "whether runtime loading is on is unknown (no vllm_env in /server_info): "
                           f"{replica_names(unknown)}",
                           "see adapter_root: the probe's load through the proxy shows it; or check that those "
                           "replicas run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    via = [r for r in up if r.via_proxy]
    seen = f" ({len(via)} seen via the proxy: {replica_names(via)})" if via else ""
    return CheckResult(name, Status.PASS, f"{len(up)} replica(s) serve {settings.base_model} with LoRA enabled "
                       f"and runtime loading on{seen}")


def _env_flag(info: ServerInfo, variable: str) -> bool | None:
    """A boolean variable of the replica's environment; None when this vLLM does not report `vllm_env`."""
    env = info.raw.get("vllm_env")
    if not isinstance(env, dict):
        return None
    return str(env.get(variable, "")).strip().lower() in ("1", "true")


def check_rank(snapshot: Snapshot, settings: StackSettings, peft_config: Any = None) -> CheckResult:
    """2. The adapter rank is at or below every replica's --max-lora-rank."""
    name = "lora_rank"
    rank = adapter_rank(settings, peft_config)
    return _lora_limit(
        snapshot, name, "max_lora_rank", rank,
        lambda per: f"adapter rank {rank} (LORA_RANK) is above the replicas' limit: {per}",
        f"restart the replicas with --max-lora-rank {round_lora_rank(rank)} (lorafleet-replica derives it from "
        f"LORA_RANK={rank}), or lower LORA_RANK",
        lambda values: f"adapter rank {rank} <= --max-lora-rank {values}")


def _lora_limit(snapshot: Snapshot, name: str, field: str, need: int, failed: Callable[[str], str], fix: str,
                passed: Callable[[str], str]) -> CheckResult:
    """Every replica's LoRA limit `field` (`--max-lora-rank`, `--max-loras`) is at least `need`; a FAIL names each
    replica below it, a PASS the values seen (a WARN while some replica could not be read)."""
    flag = "--" + field.replace("_", "-")
    with_lora = _with_lora(snapshot)
    if not with_lora:
        return _no_lora_skip(name, snapshot)
    limits = {r.url: getattr(r.info.lora, field) for r in with_lora if r.info is not None and r.info.lora is not None}
    low = ", ".join(f"{url} has {flag} {value}" for url, value in limits.items() if value < need)
    if low:
        return CheckResult(name, Status.FAIL, failed(low), fix)
    status = Status.WARN if snapshot.unreachable() else Status.PASS
    values = "/".join(map(str, sorted(set(limits.values()))))
    return CheckResult(name, status, f"{passed(values)} on {len(with_lora)} replica(s).{not_checked(snapshot)}"
                       .rstrip("."), "see lora_enabled" if status is Status.WARN else "")


def check_adapter_sync(snapshot: Snapshot, settings: StackSettings, peft_config: Any = None) -> CheckResult:
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


def check_names(snapshot: Snapshot, exclude: frozenset[str] = frozenset()) -> CheckResult:
    """5. Names are immutable: no replica binds a name to another path than the ledger; no two names share a path."""
    name = "names_immutable"
    problems: list[str] = []
    warnings: list[str] = []
    ledger = {n: norm_path(p) for n, p in (snapshot.ledger or []) if n not in exclude}
    problems += _shared_paths("the ledger", ledger)
    bound: dict[str, dict[str, list[str]]] = {}  # name -> path -> replicas
    for replica in snapshot.reachable():
        adapters = {n: norm_path(p) for n, p in (replica.adapters or {}).items() if n not in exclude}
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
                       f"path everywhere and no path has two names.{not_checked(snapshot)}".rstrip("."))


def _shared_paths(where: str, adapters: dict[str, str]) -> list[str]:
    by_path: dict[str, list[str]] = {}
    for adapter, path in adapters.items():
        by_path.setdefault(path, []).append(adapter)
    return [f"{where}: {' and '.join(sorted(names))} share the path {path}"
            for path, names in by_path.items() if len(names) > 1]


def check_slots(snapshot: Snapshot, settings: StackSettings) -> CheckResult:
    """6. --max-loras >= the slot budget, FLEET_MAX_RUNS x (max_staleness + 2), on every replica."""
    name = "lora_slots"
    need = settings.max_loras
    budget = f"MAX_STALENESS={settings.max_staleness} + 2"
    if settings.fleet_max_runs > 1:
        budget = f"FLEET_MAX_RUNS={settings.fleet_max_runs} x ({budget})"
    return _lora_limit(
        snapshot, name, "max_loras", need,
        lambda per: f"too few LoRA slots: {per}; the slot budget {budget} needs {need} (vLLM silently evicts an "
        "in-flight version otherwise)",
        f"restart those replicas with --max-loras {need} (lorafleet-replica derives it from {budget}: give every "
        "service the same .env), or lower MAX_STALENESS",
        lambda values: f"--max-loras {values} >= {need} ({budget})")


def check_versions_kept(snapshot: Snapshot, settings: StackSettings) -> CheckResult:
    """7. The newest max_staleness + 1 versions of the run are in the ledger and loaded on every replica.

    In-flight rollouts may still name any of them; an evicted one fails those rollouts (TRL retries
    4xx 30 times, then the whole run dies). A loaded version whose directory is gone kills the engine
    the next time vLLM re-reads it, so that is a failure too.
    """
    name = "versions_kept"
    if snapshot.ledger is None:
        return CheckResult(name, Status.SKIP, "no ledger (proxy unreachable)", "see fleet")
    run_lora = norm_path(str(lora_dir(settings.adapter_root, settings.run_name)))
    # On a shared fleet the ledger and the replicas name a run's versions `<run>--trl-policy-vN`: keep the fleet's
    # name of each version for the replicas' lists, the version number from the run's own name.
    named = {policy_version(run_of(n)[1]): (n, norm_path(p)) for n, p in snapshot.ledger
             if os.path.dirname(norm_path(snapshot.ledger_sources.get(n, p))) == run_lora}
    named.pop(None, None)
    if not named:
        return CheckResult(name, Status.SKIP, f"no policy version of run {settings.run_name} published yet "
                           f"(nothing under {run_lora} in the ledger)")
    newest = max(named)
    window = range(max(1, newest - settings.max_staleness), newest + 1)
    problems = []
    missing = [v for v in window if v not in named]
    if missing:
        problems.append(f"the ledger lacks {', '.join(f'v{v}' for v in missing)} of the window "
                        f"v{window.start}..v{newest} (MAX_STALENESS={settings.max_staleness})")
    for replica in snapshot.reachable():
        gone = [named[v][0] for v in window if v in named and (replica.adapters or {}).get(named[v][0]) is None]
        if gone:
            problems.append(f"{replica.url} no longer has {', '.join(gone)} loaded")
    if settings.adapter_root.is_dir():
        deleted = [named[v][0] for v in window if v in named and not Path(named[v][1], "adapter_config.json").is_file()]
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
                       f"on {len(snapshot.reachable())} replica(s).{not_checked(snapshot)}".rstrip("."),
                       "see lora_enabled" if status is Status.WARN else "")


def check_ratio(snapshot: Snapshot) -> CheckResult:
    """9. The trainer/server importance ratio of the current run stays near 1 (latest logged `ratio`), and no
    replica's ratio departs from its peers' on the same version (latest `ratio_by_replica`)."""
    name = "ratio"
    if snapshot.metrics_lines is None:
        return CheckResult(name, Status.SKIP, f"no {snapshot.metrics_path} yet: no run has logged")
    ratios = []
    by_replica: list[Any] = []
    for line in snapshot.metrics_lines:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            row = json.loads(line)
            by_replica = row.get(METRICS_KEY) or by_replica
            value = float(row.get("ratio"))
            if math.isfinite(value):
                ratios.append(value)
    odd = outliers(read_rows(by_replica))
    if odd:
        return CheckResult(name, Status.FAIL, "a replica's importance ratio departs from its peers': "
                           + "; ".join(found.evidence() for found in odd),
                           "that replica decodes the version with other weights than its peers (the base model, a "
                           "stale adapter): see its canary state in make status, and re-sync it (docs/concepts/"
                           "provenance.md)")
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



def check_layout(settings: StackSettings) -> CheckResult:
    """10. The device layout the settings give: the trainer's ranks and GPUs, the replicas' pool, no GPU shared."""
    name = "layout"
    if settings.replica_device == "cpu":
        return CheckResult(name, Status.PASS, f"trainer: TRAINER_RANKS={settings.trainer_ranks or 1} rank(s) on CPU; "
                           f"replicas on CPU: {len(settings.cpu_pool)} core set(s) in VLLM_CPU_SETS")
    if not {"trainer_gpus", "vllm_gpus"} & settings.model_fields_set:
        return CheckResult(name, Status.SKIP, f"GPU layout at its defaults (TRAINER_GPUS={settings.trainer_gpus}, "
                           f"VLLM_GPUS={settings.vllm_gpus}): nothing to judge",
                           "for a one-box GPU stack set both, disjoint (.env.example)")
    trainer = (f"trainer: TRAINER_GPUS={settings.trainer_gpus} -> {len(settings.trainer_gpu_list)} rank(s) on GPUs "
               f"(TRAINER_SHARDING={settings.trainer_sharding})")
    shared = gpus_shared(settings)
    pool = f"replicas: VLLM_GPUS={settings.vllm_gpus} ({len(settings.gpu_pool)} GPU(s), one per replica)"
    if shared:
        return CheckResult(name, Status.WARN, f"{trainer}; {pool}: GPU {','.join(shared)} in both",
                           "on one box a replica would claim a trainer GPU: make TRAINER_GPUS and VLLM_GPUS "
                           "disjoint (8 GPUs: TRAINER_GPUS=0,1 VLLM_GPUS=2,3,4,5,6,7); fine only when the replicas "
                           "run on another machine")
    return CheckResult(name, Status.PASS, f"{trainer}; {pool}; disjoint")


def check_run_keys(snapshot: Snapshot) -> CheckResult:
    """11. A fleet shared by named runs has run keys (else any client on the fleet network can act as any run)."""
    name = "run_keys"
    if snapshot.named_runs is None:
        why = snapshot.proxy_error or "no fleet URL"
        return CheckResult(name, Status.SKIP, f"the proxy's /fleet was not read: {why}",
                           "start the proxy, then run the doctor again")
    if not snapshot.named_runs:
        on = "on" if snapshot.run_keys is not None else "off"
        return CheckResult(name, Status.PASS, f"no named run on the fleet (run keys {on}): nothing to separate")
    runs = ", ".join(snapshot.named_runs)
    if snapshot.run_keys is None:
        return CheckResult(name, Status.WARN, f"runs {runs} share the fleet without run keys: any client on the fleet "
                           "network can load, unload, pause or generate as any run",
                           "set RUN_KEYS_DIR on the proxy and give each run its key (`make train RUN=<run>` does; "
                           "docs/guides/runs.md#run-keys)")
    keyless = [run for run in snapshot.named_runs if run not in snapshot.run_keys]
    if keyless:
        return CheckResult(name, Status.WARN, f"run keys on, but run(s) {', '.join(keyless)} have none: their "
                           "trainers are refused (401)", "`lorafleet run-key <run> --key-file ...` for each, "
                           "then TRAINER_RUN_KEY_FILE in its trainer")
    return CheckResult(name, Status.PASS, f"run keys on: runs {runs} each need their own key")


def check_vllm_versions(snapshot: Snapshot) -> CheckResult:
    """12. Every replica runs a vLLM of the supported range, the same one, and the proxy refused none."""
    name, supported = "vllm_versions", f"supported: {SUPPORTED[0]} to {SUPPORTED[1]}"
    refused = [r for r in snapshot.replicas if r.proxy_error and "refused: " in r.proxy_error]
    if refused:
        return CheckResult(name, Status.FAIL, "the proxy refused " + "; ".join(f"{r.url} ({r.proxy_error})"
                                                                                for r in refused),
                           "restart it as the message says (lorafleet-replica sets VLLM_SERVER_DEV_MODE=1 and "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); the proxy admits it at its next try")
    known = {r.url: r.vllm_version for r in snapshot.replicas if r.vllm_version}
    if not known:
        return CheckResult(name, Status.SKIP, "no replica's vLLM version was read" + not_checked(snapshot),
                           "see fleet")
    old, new, odd = [], [], []
    for url, version in known.items():
        where = {"unknown": odd, "older": old, "newer": new}.get(standing(version) or "")
        if where is not None:
            where.append(f"{url} ({version})")
    if old:
        return CheckResult(name, Status.FAIL, f"older than the oldest supported vLLM ({supported}): {', '.join(old)}",
                           f"upgrade those replicas to vLLM {SUPPORTED[1]} (the images' pin)")
    warnings = []
    if new:
        warnings.append(f"newer than the newest tested vLLM ({supported}): {', '.join(new)}")
    if odd:
        warnings.append(f"version not understood: {', '.join(odd)}")
    if len(set(known.values())) > 1:
        warnings.append("replicas run different vLLM versions (" + ", ".join(f"{u} {v}" for u, v in known.items())
                        + "): a mixed fleet is untested; the canary still checks that they decode alike")
    if warnings:
        return CheckResult(name, Status.WARN, "; ".join(warnings),
                           f"run one vLLM of the supported range on every replica ({supported})")
    return CheckResult(name, Status.PASS, f"{len(known)} replica(s) run vLLM {next(iter(known.values()))} "
                       f"({supported})")


def evaluate(snapshot: Snapshot, settings: StackSettings, probe: ProbeReport,
             peft_config: Any = None) -> list[CheckResult]:
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
        check_layout(settings),
        check_run_keys(snapshot),
        check_vllm_versions(snapshot),
    ]
