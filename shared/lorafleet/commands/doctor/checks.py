"""The doctor's checks: pure functions of what was observed (a Snapshot, a ProbeReport) to a CheckResult.

No I/O here beyond asking whether a run's adapter directory still exists, so every check is
unit-tested on recorded payloads. The numbers in the docstrings are the checklist's order.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lorafleet.adapters import lora_dir, policy_version
from lorafleet.commands.doctor.model import CheckResult, ProbeReport, ReplicaView, Snapshot, Status
from lorafleet.lora import adapter_rank, build_lora_config, trl_select_adapter_sync
from lorafleet.runs import run_of
from lorafleet.settings import Settings, gpus_shared, round_lora_rank
from lorafleet.vllm_api import ServerInfo

RATIO_WARN = 0.01  # |ratio - 1| above this: WARN
RATIO_FAIL = 0.05  # |ratio - 1| above this: FAIL


def _names(replicas: Sequence[ReplicaView]) -> str:
    return ", ".join(replica.label for replica in replicas)


def _not_checked(snapshot: Snapshot) -> str:
    down = snapshot.unreachable()
    return f" Not checked (unreachable, see lora_enabled): {_names(down)}." if down else ""


def _with_lora(snapshot: Snapshot) -> list[ReplicaView]:
    """The reachable replicas served with --enable-lora: the ones whose LoRA limits can be checked."""
    return [replica for replica in snapshot.reachable() if replica.info is not None and replica.info.lora is not None]


def _no_lora_skip(name: str, snapshot: Snapshot) -> CheckResult:
    return CheckResult(name, Status.SKIP, "no reachable replica with LoRA enabled" + _not_checked(snapshot),
                       "see lora_enabled")


def norm_path(path: str) -> str:
    """A path as vLLM and the ledger may spell it differently (trailing slash, `..`): normalised, "" kept."""
    return os.path.normpath(path) if path else path



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
    departed = [r for r in listed if r.proxy_canary_failure]
    if departed:
        return CheckResult(name, Status.FAIL, "decodes with other weights than its peers (the proxy's agreement "
                           "canary took it out of routing): " + "; ".join(f"{r.url}: {r.proxy_canary_failure}"
                                                                          for r in departed),
                           "the proxy re-syncs it (adapter reloaded, prefix cache reset) and re-admits it once it "
                           "agrees; if it keeps departing, restart that replica and report the engine's version")
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
    runtime = {r.url: _env_flag(r.info, "VLLM_ALLOW_RUNTIME_LORA_UPDATING") for r in up if r.info is not None}
    no_runtime = [r for r in up if runtime.get(r.url) is False]
    unknown = [r for r in up if r.url in runtime and runtime[r.url] is None]
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
    if unknown:
        return CheckResult(name, Status.WARN, f"{len(up)} replica(s) serve {settings.base_model} with LoRA enabled; "
                           f"whether runtime loading is on is unknown (no vllm_env in /server_info): {_names(unknown)}",
                           "see adapter_root: the probe's load through the proxy shows it; or check that those "
                           "replicas run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    via = [r for r in up if r.via_proxy]
    seen = f" ({len(via)} seen via the proxy: {_names(via)})" if via else ""
    return CheckResult(name, Status.PASS, f"{len(up)} replica(s) serve {settings.base_model} with LoRA enabled "
                       f"and runtime loading on{seen}")


def _env_flag(info: ServerInfo, variable: str) -> bool | None:
    """A boolean variable of the replica's environment; None when this vLLM does not report `vllm_env`."""
    env = info.raw.get("vllm_env")
    if not isinstance(env, dict):
        return None
    return str(env.get(variable, "")).strip().lower() in ("1", "true")


def check_rank(snapshot: Snapshot, settings: Settings, peft_config: Any = None) -> CheckResult:
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
    return CheckResult(name, status, f"{passed(values)} on {len(with_lora)} replica(s).{_not_checked(snapshot)}"
                       .rstrip("."), "see lora_enabled" if status is Status.WARN else "")


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
                       f"path everywhere and no path has two names.{_not_checked(snapshot)}".rstrip("."))


def _shared_paths(where: str, adapters: dict[str, str]) -> list[str]:
    by_path: dict[str, list[str]] = {}
    for adapter, path in adapters.items():
        by_path.setdefault(path, []).append(adapter)
    return [f"{where}: {' and '.join(sorted(names))} share the path {path}"
            for path, names in by_path.items() if len(names) > 1]


def check_slots(snapshot: Snapshot, settings: Settings) -> CheckResult:
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


def check_versions_kept(snapshot: Snapshot, settings: Settings) -> CheckResult:
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
             if os.path.dirname(norm_path(p)) == run_lora}
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
    """8. Load, unload, pause and resume through the proxy reached every replica (seen on each replica).

    The pause is sent in `wait` mode, which the proxy always broadcasts. The trainer's own `keep`
    pause is sent too: under PROXY_SYNC_PAUSE=elide the proxy answers it without pausing any replica
    (by design, so generation never stalls on a sync); that is reported, not failed.
    """
    name = "broadcasts"
    if not report.broadcast:
        return CheckResult(name, Status.SKIP, report.skipped or "no proxy to broadcast through", "see fleet")
    if not report.paused:
        return CheckResult(name, Status.SKIP, report.skipped or "no replica observed: nothing was broadcast",
                           _skip_fix(report.skipped) or "see fleet and lora_enabled")
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
    keep, keep_problem = _keep_pause(report, snapshot)
    if keep_problem:
        problems.append(keep_problem)
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "the proxy must broadcast to every replica: check its log for that replica (state, "
                           "last_error in GET /fleet); a replica it does not know gets no broadcasts")
    count = len(report.paused)
    if not report.path or report.load_error is not None or report.skipped:
        why = report.skipped or "the probe load failed"
        return CheckResult(name, Status.WARN, f"pause, resume reached all {count} replica(s); {keep}; load and "
                           f"unload were not observed: {why}", "see adapter_root")
    return CheckResult(name, Status.PASS, f"load, unload, pause, resume through the proxy observed on all "
                       f"{count} replica(s); {keep}")


def _keep_pause(report: ProbeReport, snapshot: Snapshot) -> tuple[str, str]:
    """What the trainer's `keep` pause did, and a problem when that contradicts the proxy's PROXY_SYNC_PAUSE."""
    if report.keep_error:
        return "", f"the trainer's keep pause through the proxy failed: {report.keep_error}"
    if not report.keep_paused:
        return "", "the trainer's keep pause was not observed on any replica"
    paused = [url for url, state in report.keep_paused.items() if state is True]
    mode = snapshot.sync_pause
    if not paused:
        if mode == "broadcast":
            return "", "keep pause did not reach any replica although the proxy reports PROXY_SYNC_PAUSE=broadcast"
        return (f"the trainer's keep pause is elided (PROXY_SYNC_PAUSE={mode or 'not reported'}): replicas keep "
                "generating during weight syncs"), ""
    if len(paused) < len(report.keep_paused):
        missed = [url for url in report.keep_paused if url not in paused]
        return "", f"keep pause reached {', '.join(paused)} but not {', '.join(missed)}"
    if mode == "elide":
        return "", "the proxy reports PROXY_SYNC_PAUSE=elide but the trainer's keep pause paused every replica"
    return f"the trainer's keep pause is broadcast (PROXY_SYNC_PAUSE={mode or 'not reported'})", ""


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



def check_layout(settings: Settings) -> CheckResult:
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
                           "README \"Run keys\")")
    keyless = [run for run in snapshot.named_runs if run not in snapshot.run_keys]
    if keyless:
        return CheckResult(name, Status.WARN, f"run keys on, but run(s) {', '.join(keyless)} have none: their "
                           "trainers are refused (401)", "`lorafleet run-key <run> --key-file ...` for each, "
                           "then TRAINER_RUN_KEY_FILE in its trainer")
    return CheckResult(name, Status.PASS, f"run keys on: runs {runs} each need their own key")


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
        check_layout(settings),
        check_run_keys(snapshot),
    ]
