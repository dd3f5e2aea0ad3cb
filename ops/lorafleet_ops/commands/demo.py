"""`lorafleet demo`: the whole topology on CPU, for real, in a few minutes; `--device gpu` on the host's GPUs.

Makes the model ready (the offline tiny model, or the task's: lorafleet_ops.base_model), starts replicas through
`lorafleet-replica` (CPU core sets, or with `--device gpu`
GPUs as lorafleet_ops.placement lays them out: one per GPU or several sharing one), the proxy in front
of them and the real trainer on the `tiny` recipe; shows live progress; then writes a report
(JSON and a PNG plot) whose every number comes from this run: the trainer's metrics.jsonl, the
proxy's /fleet and the replicas' own /metrics. Everything started is stopped on exit, Ctrl-C too.

`--runs N` (N > 1) trains N runs at once on the same replicas, each its own trainer under its run
prefix (`/runs/<run>`, runs a, b, ...), the replicas sized for them and for the doctor's probe
(`FLEET_MAX_RUNS=N+1`): the report has each run's reward, ratio and syncs, its share of the generated
tokens (the proxy's fair share), and the doctor's checklist per run.
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import httpx
from lorafleet.adapters import metrics_path, policy_version
from lorafleet.runs import run_url
from lorafleet.vllm_api import metric_total

from lorafleet_ops import base_model
from lorafleet_ops.commands.progress import EVAL_PASS, ChangedOnly, read_progress, render, wall_budget
from lorafleet_ops.commands.status import adapter_span, fmt, latest, read_metrics
from lorafleet_ops.docsite.record import RECORD_KEY, run_record
from lorafleet_ops.placement import Placement, TrainerPolicy, place
from lorafleet_ops.processes import (
    Service,
    free_port,
    proxy_service,
    replica_service,
    start_in_waves,
    trainer_service,
    wait_healthy,
)


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    replicas: int = 2
    steps: int | None = None  # None: TINY_DEMO_STEPS for the tiny task, a task file's own max_steps otherwise
    runs: int = 1
    startup_timeout_s: float = 300.0
    task: str = "tiny"  # TRAINER_TASK: a built-in task or a task file (its path)
    eval_every_steps: int = 5
    device: Literal["cpu", "gpu"] = "cpu"
    gpus: tuple[int, ...] = ()  # --device gpu: the GPUs to use (empty: every GPU nvidia-smi lists)
    trainer_gpu: TrainerPolicy = "auto"  # --device gpu: the trainer on a GPU of its own or sharing one
    model: str | None = None  # BASE_MODEL: tiny, a named model or a folder (None: the task's default, else tiny)
    seed: int = 0  # the trainer's SEED (TRL's seed: the adapter's initial weights, its random streams)


TINY_DEMO_STEPS = 60
SINGLE_RUN = "demo"  # the single-run demo's RUN_NAME, on the default run (no prefix)


def run_names(count: int) -> list[str]:
    """The demo's runs: one default run named `demo`, or named runs a, b, c, ... sharing the fleet."""
    if count < 1 or count > 26:
        raise ValueError(f"--runs must be between 1 and 26, got {count}")
    return [SINGLE_RUN] if count == 1 else [chr(ord("a") + i) for i in range(count)]


def trainer_url(proxy_url: str, run: str, count: int) -> str:
    """The fleet URL a run's trainer uses: the proxy itself for the single run, else its run prefix."""
    return proxy_url if count == 1 else run_url(proxy_url, run)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _say(message: str) -> None:
    print(message, flush=True)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row[key])) for row in rows if key in row and "step" in row]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def replica_cache_stats(urls: list[str]) -> dict[str, Any]:
    """Prefix-cache queries and hits (tokens) from each replica's own /metrics."""
    per_replica = {}
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        queries = metric_total(text, "vllm:prefix_cache_queries_total")
        hits = metric_total(text, "vllm:prefix_cache_hits_total")
        per_replica[url] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}
    queries = sum(v["queries"] for v in per_replica.values())
    hits = sum(v["hits"] for v in per_replica.values())
    return {"replicas": per_replica, "hit_rate": hits / queries if queries else None}


EVAL_NONZERO = "eval/nonzero/"  # per reward function: the share of eval rows it scored (a format rate)
TOOL_CALLS = "tools/call_frequency"  # TRL: tool calls per rollout, the window's mean
TOOLS_GIVEN = "tools/loop_exhausted_frac"  # TRL logs it only when the task has tools


def uses_tools(rows: list[dict[str, Any]]) -> bool:
    """Whether the run's task had tools: TRL parses (and counts) calls of unknown tools in any task."""
    return any(TOOLS_GIVEN in row for row in rows) and bool(_series(rows, TOOL_CALLS))


def first_and_last(metrics: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The mean of `key` over the first and over the last few steps that logged it."""
    values = [value for _, value in _series(metrics, key)]
    window = max(1, min(5, len(values) // 3))
    return {"first_steps_mean": _mean(values[:window]), "last_steps_mean": _mean(values[-window:]),
            "window_steps": window}


def run_report(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's training, from its metrics.jsonl: steps, reward (and tool calls) first vs last steps, ratio range,
    syncs, and the eval passes (pass@1 and reward per pass)."""
    ratios = [value for _, value in _series(metrics, "ratio")]
    syncs = [value for _, value in _series(metrics, "perf/weight_sync_s")]
    report = {
        "steps": latest(metrics, "step"),
        "reward": first_and_last(metrics, "reward"),
        "importance_ratio": {"min": min(ratios, default=None), "max": max(ratios, default=None)},
        "weight_sync_s": {"p50": _percentile(syncs, 0.5), "p95": _percentile(syncs, 0.95), "count": len(syncs)},
        "episodes_mixed_versions_frac": latest(metrics, "episodes/mixed_versions_frac"),
    }
    if uses_tools(metrics):
        report["tool_calls_per_rollout"] = first_and_last(metrics, TOOL_CALLS)
    evals = [{"step": int(row["eval/step"]), "model_version": int(row["eval/model_version"]),
              "pass_at_1": row[EVAL_PASS], "reward": row.get("eval/reward"),
              "nonzero": {key.removeprefix(EVAL_NONZERO): value for key, value in row.items()
                          if key.startswith(EVAL_NONZERO)}} for row in metrics if EVAL_PASS in row]
    if evals:
        report["eval"] = evals
        report["eval_pass_at_1"] = {"first": evals[0]["pass_at_1"], "last": evals[-1]["pass_at_1"],
                                    "best": max(row["pass_at_1"] for row in evals),
                                    "change_points": round(100 * (evals[-1]["pass_at_1"] - evals[0]["pass_at_1"]), 1)}
    return report


def fleet_report(fleet: dict[str, Any], cache: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What the fleet did: wall clock, the replicas' prefix cache, routing, and the adapters each holds."""
    return {
        "wall_clock_s": round(wall_s, 1),
        "prefix_cache": cache,
        "routing": fleet.get("router", {}),
        "adapters": {
            "ledger": [entry["name"] for entry in fleet.get("ledger", [])],
            "loaded_on": {r["url"]: sorted(r.get("adapters", {})) for r in fleet.get("replicas", [])},
        },
    }


def build_report(metrics: list[dict[str, Any]], fleet: dict[str, Any], cache: dict[str, Any],
                 wall_s: float) -> dict[str, Any]:
    """The single-run report: the run's training and the fleet's numbers side by side."""
    return {**fleet_report(fleet, cache, wall_s), **run_report(metrics)}


def shared_report(metrics: dict[str, list[dict[str, Any]]], fleet: dict[str, Any], cache: dict[str, Any],
                  wall_s: float) -> dict[str, Any]:
    """The several-runs report: the fleet's numbers, and per run its training plus what the proxy counted for it
    (weight, generated tokens, its share of them: `/fleet`'s runs)."""
    counted = {row["run"]: row for row in fleet.get("runs", [])}
    runs = {}
    for run, rows in metrics.items():
        row = counted.get(run, {})
        runs[run] = {**run_report(rows), "weight": row.get("weight"), "generated_tokens": row.get("generated_tokens"),
                     "token_share": row.get("share")}
    return {**fleet_report(fleet, cache, wall_s), "runs": runs}


# --- weight-sync cost: what each adapter publish cost generation (PROXY_SYNC_PAUSE) ----------------------
def _sample(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples called `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()))


def sync_report(proxy_metrics: str, fleet: dict[str, Any], generated_tokens: float, metrics: list[dict[str, Any]],
                trainer_s: float) -> dict[str, Any]:
    """Per sync, from the proxy's /metrics: how long the replicas stayed paused, how long the adapter load took,
    and the stall that bounds: paused time, plus the load for an elided sync (the engine loads between steps).
    Also generated tokens/s (the replicas' counters over the trainer's run) and steps per minute."""
    syncs = max((policy_version(entry["name"]) or 0 for entry in fleet.get("ledger", [])), default=0)
    elided = metric_total(proxy_metrics, "lorafleet_proxy_pauses_elided_total")
    loads = _sample(proxy_metrics, "lorafleet_proxy_broadcast_duration_seconds_count", op="load")
    load_s = _sample(proxy_metrics, "lorafleet_proxy_broadcast_duration_seconds_sum", op="load") / max(loads, 1)
    paused_s = _sample(proxy_metrics, "lorafleet_proxy_pause_duration_seconds_sum") / syncs if syncs else None
    timed = [(row["step"], row["time"]) for row in metrics if "reward" in row and "time" in row]
    span = timed[-1][1] - timed[0][1] if len(timed) > 1 else 0.0
    return {
        "mode": fleet.get("sync_pause"),
        "syncs": syncs,
        "pauses_elided": elided,
        "paused_per_sync_s": paused_s,
        "load_per_sync_s": load_s,
        "stall_per_sync_s": None if paused_s is None else paused_s + min(elided / syncs, 1.0) * load_s,
        "generated_tokens_per_s": generated_tokens / trainer_s if trainer_s else None,
        "steps_per_minute": 60 * (timed[-1][0] - timed[0][0]) / span if span else None,
        "trainer_s": round(trainer_s, 1),
    }


def generated_tokens(urls: list[str]) -> float:
    """Tokens the replicas generated (their own vllm:generation_tokens counters)."""
    return sum(metric_total(httpx.get(url + "/metrics", timeout=10).text, "vllm:generation_tokens_total")
               for url in urls)


def sync_lines(sync: dict[str, Any]) -> list[str]:
    return [
        f"weight sync stall (PROXY_SYNC_PAUSE={sync['mode']}): at most {fmt(sync['stall_per_sync_s'], '.3f')}s per "
        f"sync (replicas paused {fmt(sync['paused_per_sync_s'], '.3f')}s, adapter load {sync['load_per_sync_s']:.3f}s;"
        f" {sync['pauses_elided']:.0f} of {sync['syncs']} pauses elided)",
        f"generation {fmt(sync['generated_tokens_per_s'], '.0f')} tokens/s; {fmt(sync['steps_per_minute'], '.1f')} "
        f"steps/min; trainer ran {sync['trainer_s']:.0f}s",
    ]


def plot_report(metrics: dict[str, list[dict[str, Any]]], path: Path, title: str = "tiny task",
                device: str = "cpu") -> None:
    """Reward, importance ratio, the held-out eval (pass@1 and how often each reward function scored) and
    weight-sync latency per step, one line per run, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "reward"), ("ratio", "importance ratio")]
    evaluated = any(EVAL_PASS in row for rows in metrics.values() for row in rows)
    if evaluated:
        panels.append((EVAL_PASS, "held-out eval"))
    if any(uses_tools(rows) for rows in metrics.values()):
        panels.append((TOOL_CALLS, "tool calls per rollout"))
    panels.append(("perf/weight_sync_s", "weight sync (s)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True)
    top, bottom = axes[0], axes[-1]
    for axis, (key, label) in zip(axes, panels, strict=True):
        for run, rows in metrics.items():
            if key == EVAL_PASS:
                plot_eval(axis, rows, f" run {run}" if len(metrics) > 1 else "")
                continue
            points = _series(rows, key)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", markersize=3,
                          label=f"run {run}" if len(metrics) > 1 else "training")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    if len(metrics) > 1:
        top.legend()
    bottom.set_xlabel("optimizer step")
    top.set_title(f"lorafleet demo: {title} on {device.upper()}" + (f", {len(metrics)} runs sharing the fleet"
                                                       if len(metrics) > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_eval(axis: Any, rows: list[dict[str, Any]], suffix: str) -> None:
    """The eval passes (x = the step each started at): pass@1 and each reward function's nonzero share."""
    evals = [row for row in rows if EVAL_PASS in row]
    if not evals:
        return
    steps = [int(row["eval/step"]) for row in evals]
    axis.plot(steps, [float(row[EVAL_PASS]) for row in evals], marker="s", label=f"pass@1{suffix}")
    for key in sorted({key for row in evals for key in row if key.startswith(EVAL_NONZERO)}):
        axis.plot(steps, [float(row.get(key, 0.0)) for row in evals], marker=".", linestyle="--",
                  label=f"{key.removeprefix(EVAL_NONZERO)} > 0{suffix}")
    axis.set_ylim(-0.02, 1.02)
    axis.legend(fontsize=8)


def device_settings(options: DemoOptions) -> tuple[dict[str, str], dict[str, str], Placement | None]:
    """The replicas' and the trainer's device settings: CPU core sets (float32: exact ratios), or the GPUs as
    lorafleet_ops.placement lays them out (bf16, as a GPU run trains); raises PlacementError before anything starts."""
    if options.device == "cpu":
        cores = ";".join(str(i % 2) if i < 2 else "0-1" for i in range(options.replicas))
        return {"REPLICA_DEVICE": "cpu", "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": cores}, {}, None
    placement = place(options.gpus, options.replicas, options.trainer_gpu)
    return {**placement.replica_env(), "VLLM_DTYPE": "bfloat16"}, placement.trainer_env(), placement


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Start everything, train, report, stop everything. Returns the report."""
    runs = run_names(options.runs)
    replica_env, trainer_env, placement = device_settings(options)
    out = options.out.resolve()
    task = str(Path(options.task).resolve()) if options.task.endswith(".py") else options.task
    steps = options.steps or (TINY_DEMO_STEPS if options.task == "tiny" else None)
    work = out / "work"
    adapter_root = work / "adapters"
    shutil.rmtree(adapter_root, ignore_errors=True)  # a fresh fleet state and run every time
    logs = out / "logs"
    started: list[Service] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    begin = time.monotonic()
    try:
        defaults = base_model.task_defaults(task)
        model_name = options.model or defaults.get("base_model", base_model.TINY)
        model = base_model.prepare(model_name, work, _say)
        common = {"MAX_MODEL_LEN": "512", **base_model.common_env(defaults), "BASE_MODEL": model,
                  "ADAPTER_ROOT": str(adapter_root), "RUN_NAME": runs[0], "LOG_LEVEL": "INFO"}
        if len(runs) > 1:  # --max-loras holds every run's slots (FLEET_MAX_RUNS x (staleness + 2)), plus one run's
            # worth for the doctor's probe, which loads as the default run (the trainers' preflight and the report's)
            common["FLEET_MAX_RUNS"] = str(len(runs) + 1)
        _say(f"==> starting {options.replicas} {options.device.upper()} replicas (vLLM, {replica_env['VLLM_DTYPE']}, "
             f"runtime LoRA); logs in {logs}" + (f"\n    {placement.describe()}" if placement else ""))
        replicas = [replica_service(f"replica-{i + 1}", {**common, **replica_env}, logs)
                    for i in range(options.replicas)]
        started += replicas
        start_in_waves(replicas, placement.wave if placement else len(replicas), options.startup_timeout_s)
        _say(f"    replicas healthy after {time.monotonic() - begin:.0f}s: {', '.join(r.url for r in replicas)}")
        proxy = proxy_service("proxy", {**common, "PROXY_UPSTREAMS": ",".join(r.url for r in replicas)}, logs)
        started.append(proxy.start())
        wait_healthy([proxy], timeout_s=60)
        _say(f"==> proxy ready at {proxy.url}; training {steps or 'its own max_steps of'} steps on task {options.task}"
             + (f" in {len(runs)} runs at once ({', '.join(runs)}), each under {proxy.url}/runs/<run>"
                if len(runs) > 1 else ""))
        trainers: dict[str, Service] = {}
        for run in runs:
            metrics_port = free_port()
            trainers[run] = trainer_service(
                "trainer" if len(runs) == 1 else f"trainer-{run}",
                {**common, **trainer_env, "RUN_NAME": run, "TRAINER_TASK": task, "SEED": str(options.seed),
                 "EVAL_EVERY_STEPS": str(options.eval_every_steps),
                 "TRAINER_VLLM_URL": trainer_url(proxy.url, run, len(runs)), "TRAINER_METRICS_PORT": str(metrics_port),
                 **({"MAX_STEPS": str(steps)} if steps else {})}, logs).start()
            started.append(trainers[run])
            _say(f"    run {run}: trainer metrics on http://127.0.0.1:{metrics_port}/metrics")
        trainer_began = time.monotonic()
        _say(f"    Prometheus metrics while it runs: proxy {proxy.url}/metrics, "
             f"replicas {', '.join(r.url + '/metrics' for r in replicas)}")
        metrics_files = {run: metrics_path(adapter_root, run) for run in runs}
        fleet: dict[str, Any] = {}
        budget, changed = wall_budget(defaults), ChangedOnly()
        with httpx.Client(timeout=10) as client:
            while any(trainer.alive for trainer in trainers.values()):
                time.sleep(3)
                fleet = client.get(proxy.url + "/fleet").json()
                for run, path in metrics_files.items():
                    progress = read_progress(steps, read_metrics(path), fleet, options.eval_every_steps)
                    if changed.due(run, progress):
                        now = time.monotonic()
                        line = render(progress, now - begin, budget and budget - (now - trainer_began))
                        _say(line if len(runs) == 1 else f"run {run} {line}")
            fleet = client.get(proxy.url + "/fleet").json()
            trainer_s = time.monotonic() - trainer_began
            proxy_metrics = client.get(proxy.url + "/metrics").text
        for run, trainer in trainers.items():
            assert trainer.process is not None
            if trainer.process.returncode != 0:
                raise RuntimeError(f"the trainer of run {run} failed (exit {trainer.process.returncode}):\n"
                                   f"{trainer.log_tail(60)}")
        metrics = {run: read_metrics(path) for run, path in metrics_files.items()}
        cache = replica_cache_stats([r.url for r in replicas])
        if len(runs) == 1:
            report = build_report(metrics[runs[0]], fleet, cache, time.monotonic() - begin)
            report["sync"] = sync_report(proxy_metrics, fleet, generated_tokens([r.url for r in replicas]),
                                         metrics[runs[0]], trainer_s)
        else:
            report = shared_report(metrics, fleet, cache, time.monotonic() - begin)
        _say("==> lorafleet doctor against the demo fleet" + (", once per run" if len(runs) > 1 else ""))
        doctor_env = {**common, **{key: value for key, value in {**replica_env, **trainer_env}.items()
                                   if key != "CUDA_VISIBLE_DEVICES"}}
        report["doctor"], report["doctor_failed"] = doctor_tables(doctor_env, proxy.url, runs)
        report.update(task=options.task, base_model=model_name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({RECORD_KEY: run_record(), **report}, indent=2) + "\n")
        plot_report(metrics, out / "report.png", title=f"task {Path(options.task).stem}", device=options.device)
        return report
    finally:
        if started:
            _say(f"==> stopping {len(started)} processes")
        for service in reversed(started):
            service.stop()
        signal.signal(signal.SIGTERM, previous)


def doctor_tables(settings_env: dict[str, str], proxy_url: str, runs: list[str]) -> tuple[str, list[str]]:
    """The doctor's checklist against the fleet the demo trained on (before it is stopped), once per run under its
    own name (its versions, its ratio) and, like a trainer on a shared fleet, against the proxy itself; the probe
    once, in the first: the table(s) and the failed checks (`<run>: <check>` with several runs)."""
    from lorafleet.settings import StackSettings, env_name, load_settings

    from lorafleet_ops.commands.doctor import failed, render_table, run_doctor_sync

    fields = {env_name(name): name for name in StackSettings.model_fields}
    tables, failures = [], []
    for index, run in enumerate(runs):
        values = {fields[key]: value for key, value in settings_env.items()}
        values.update(run_name=run, trainer_vllm_url=trainer_url(proxy_url, run, len(runs)))
        settings = load_settings(**values)
        results = run_doctor_sync(settings, proxy_url, probe=index == 0)  # the trainers have exited: nothing trains
        tables.append(render_table(results) if len(runs) == 1 else f"run {run}:\n{render_table(results)}")
        failures += [result.name if len(runs) == 1 else f"{run}: {result.name}" for result in failed(results)]
    return "\n\n".join(tables), failures


def run_lines(report: dict[str, Any]) -> list[str]:
    """One run's training, as the summary prints it."""
    reward, ratio, sync = report["reward"], report["importance_ratio"], report["weight_sync_s"]
    return [
        f"reward: first {reward['window_steps']} steps {fmt(reward['first_steps_mean'], '.3f')} -> "
        f"last {reward['window_steps']} steps {fmt(reward['last_steps_mean'], '.3f')}",
        f"importance ratio: {fmt(ratio['min'], '.4f')} .. {fmt(ratio['max'], '.4f')}",
        f"weight sync: p50 {fmt(sync['p50'], '.2f')}s  p95 {fmt(sync['p95'], '.2f')}s  ({sync['count']} syncs)",
    ] + ([f"tool calls per rollout: first {calls['window_steps']} steps {fmt(calls['first_steps_mean'], '.3f')} -> "
          f"last {calls['window_steps']} steps {fmt(calls['last_steps_mean'], '.3f')}"]
         if (calls := report.get("tool_calls_per_rollout")) else []) + (
        ["eval pass@1 by step: " + ", ".join(f"{row['step']}: {fmt(row['pass_at_1'], '.2f')}"
                                              for row in report["eval"])] if report.get("eval") else []) + [
        f"eval {name} > 0 by step: " + ", ".join(f"{row['step']}: {fmt(row['nonzero'].get(name), '.2f')}"
                                                 for row in report["eval"])
        for name in sorted({name for row in report.get("eval", []) for name in row.get("nonzero", {})})]


def summary(report: dict[str, Any]) -> str:
    router = report["routing"]
    routed = router.get("routed", 0)
    if "runs" in report:
        lines = [f"{len(report['runs'])} runs sharing the fleet in {report['wall_clock_s']:.0f}s"]
        for run, row in report["runs"].items():
            lines.append(f"run {run}: steps {row['steps']}, weight {fmt(row['weight'], '.0f')}, "
                         f"{fmt(row['generated_tokens'], '.0f')} tokens generated, "
                         f"share {fmt(row['token_share'], '.1%')}")
            lines += [f"  {line}" for line in run_lines(row)]
    else:
        lines = [f"steps {report['steps']} in {report['wall_clock_s']:.0f}s", *run_lines(report)]
    lines += [
        f"prefix cache hit rate (replicas' /metrics): {fmt(report['prefix_cache']['hit_rate'], '.1%')}",
        f"routing: {routed} routed, affinity {router.get('affinity', 0)}, spilled {router.get('spilled', 0)}, "
        f"unmatched {router.get('unmatched', 0)}",
        f"adapters in the ledger: {adapter_span(report['adapters']['ledger'])}",
    ]
    lines += [f"  {url}: {adapter_span(names)}" for url, names in report["adapters"]["loaded_on"].items()]
    if "sync" in report:
        lines += sync_lines(report["sync"])
    if "doctor" in report:
        lines += ["", "doctor:", report["doctor"]]
    return "\n".join(lines)


def main(options: DemoOptions) -> int:
    try:
        report = run_demo(options)
    except KeyboardInterrupt:
        _say("interrupted: everything started was stopped")
        return 130
    except (RuntimeError, TimeoutError) as exc:
        print(f"lorafleet demo failed: {exc}", file=sys.stderr)
        return 1
    _say("\n==> report\n" + summary(report))
    _say(f"\nwritten: {options.out / 'report.json'} and {options.out / 'report.png'}")
    if report.get("doctor_failed"):
        print(f"lorafleet demo FAILED: the doctor found problems in the fleet it trained on: "
              f"{', '.join(report['doctor_failed'])} (see the doctor table above)", file=sys.stderr)
        return 1
    return 0
