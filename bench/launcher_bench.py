"""`lorafleet-train` under its rank launcher vs one plain process, side by side, on one GPU.

`make bench-launcher` runs the real entrypoint (`python -m lorafleet_trainer.main`) twice with the same settings:
TRAINER_SHARDING=fsdp2 (the launcher starts one FSDP2 rank: the code path several GPUs use) and
TRAINER_SHARDING=auto (one plain process). Generation is bench/vllm_standin.py; TRL's rollout worker is let start
without vLLM by bench/standin_site/sitecustomize.py (benchmark processes only). Each run records TRL's own step
time and MFU from metrics.jsonl, whether the launcher ran (`launching_ranks`), the adapters the stand-in loaded,
and its exit code. `--resume` adds a SIGTERM checkpoint + restart of the first configuration.
`--tiny` is the CPU smoke (2 DDP ranks vs one process, the tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
from lorafleet_ops.docsite.record import write_result
from trainer_bench import build_workload, environment, start_standin, step_metrics  # a sibling (bench/)

HERE = Path(__file__).resolve().parent

GPU_RUNS = {"fsdp2-1rank": {"TRAINER_SHARDING": "fsdp2", "TRAINER_GPUS": "0"},
            "auto-1process": {"TRAINER_SHARDING": "auto", "TRAINER_GPUS": "0"}}
CPU_RUNS = {"ddp-2ranks": {"TRAINER_SHARDING": "ddp", "TRAINER_RANKS": "2"},
            "auto-1process": {"TRAINER_SHARDING": "auto", "TRAINER_RANKS": "0"}}


def trainer_env(workload: dict[str, Any], url: str, work: Path, run: str, args: argparse.Namespace,
                extra: dict[str, str]) -> dict[str, str]:
    """lorafleet-train's settings (environment variables) for one run; the same for every configuration."""
    paths = [str(HERE / "standin_site"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": ":".join(p for p in paths if p), "LORAFLEET_BENCH_STANDIN": "1",
           "LORAFLEET_ENV_FILE": "", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1",
           "TRAINER_TASK": "math", "BASE_MODEL": workload["model_dir"], "DATASET_PATH": workload["dataset"],
           "ADAPTER_ROOT": str(work / "adapters"), "RUN_NAME": run, "TRAINER_VLLM_URL": url,
           "TRAINER_REPLICAS": "1", "MAX_STEPS": str(args.steps), "SAVE_STEPS": "100000",
           "TOKEN_BUDGET": str(args.token_budget), "GRADIENT_ACCUMULATION_STEPS": str(args.accumulation),
           "WEIGHT_SYNC_STEPS": "1", "TRAINER_METRICS_PORT": "0", "TRAINER_REPORT_TO": "none",
           "TRAINER_RESUME": "true", **extra}
    if args.tiny:
        env.update({"MAX_COMPLETION_LENGTH": "24", "NUM_GENERATIONS": "4", "MAX_INFLIGHT_PER_REPLICA": "16",
                    "TRAINER_CPU_THREADS": "1", "TRAINER_ATTENTION": "torch"})
    return env


def run_trainer(env: dict[str, str], log_path: Path, timeout: float, sigterm_after_step: int = 0,
                metrics: Path | None = None) -> dict[str, Any]:
    """One `lorafleet-train` process; optionally SIGTERM it once metrics.jsonl shows `sigterm_after_step`."""
    started = time.perf_counter()
    with log_path.open("a") as log:
        process = subprocess.Popen([sys.executable, "-m", "lorafleet_trainer.main"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        deadline, signalled = started + timeout, False
        while process.poll() is None and time.perf_counter() < deadline:
            if sigterm_after_step and not signalled and metrics and metrics.exists() and \
                    len(metrics.read_text().splitlines()) >= sigterm_after_step:
                process.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.5)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return {"exit_code": process.returncode, "wall_s": round(time.perf_counter() - started, 1), "sigterm": signalled}


def log_events(log_path: Path, *names: str) -> list[str]:
    return [line.strip() for line in log_path.read_text(errors="replace").splitlines()
            if any(f"event={name}" in line or f'"event": "{name}"' in line for name in names)]


def run_config(name: str, extra: dict[str, str], workload: dict[str, Any], work: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """One configuration against a fresh stand-in (adapters numbered from v1)."""
    run_dir = work / "adapters" / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log_path = work / f"{name}.log"
    log_path.unlink(missing_ok=True)
    standin, url = start_standin(workload, args.tiny)
    try:
        env = trainer_env(workload, url, work, name, args, extra)
        process = run_trainer(env, log_path, args.config_timeout)
        stats = requests.get(f"{url}/standin/stats", timeout=5).json()
    finally:
        standin.terminate()
        standin.wait(timeout=10)
    metrics = run_dir / "metrics.jsonl"
    return {"name": name, "settings": extra, **process,
            "launcher": log_events(log_path, "launching_ranks"),
            "adapter_loads": stats.get("loads"), "final_adapter": (run_dir / "final-adapter").is_dir(),
            "trl": step_metrics(metrics, 2, args.steps) if metrics.exists() else None,
            "log_tail": log_path.read_text(errors="replace").splitlines()[-8:] if process["exit_code"] else []}


def resume_check(name: str, extra: dict[str, str], workload: dict[str, Any], work: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    """SIGTERM after step 2 (checkpoint at the next step), then a restart that must resume and finish."""
    run_dir = work / "adapters" / "runs" / f"{name}-resume"
    shutil.rmtree(run_dir, ignore_errors=True)
    log_path = work / f"{name}-resume.log"
    log_path.unlink(missing_ok=True)
    standin, url = start_standin(workload, args.tiny)
    try:
        env = trainer_env(workload, url, work, f"{name}-resume", args, extra)
        first = run_trainer(env, log_path, args.config_timeout, sigterm_after_step=2, metrics=run_dir / "metrics.jsonl")
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*"))
        second = run_trainer(env, log_path, args.config_timeout)
    finally:
        standin.terminate()
        standin.wait(timeout=10)
    return {"name": f"{name}-resume", "stopped": first, "checkpoints_after_stop": checkpoints, "restarted": second,
            "resumed": log_events(log_path, "resuming"), "final_adapter": (run_dir / "final-adapter").is_dir()}


def _med(result: dict[str, Any], key: str) -> Any:
    value = ((result.get("trl") or {}).get(key) or {}).get("median")
    return None if value is None else round(value, 3 if "mfu" not in key else 1)


def table(report: dict[str, Any]) -> str:
    """The README's rows, from the JSON."""
    shape = report["shape"]
    lines = [f"`{report['command']}` on {report['gpu'] or 'CPU'}, {report['date']} (torch {report['torch']}, TRL "
             f"{report['trl']}); shape {shape['model']}, token budget {shape['token_budget']:,} x "
             f"{shape['accumulation']}, {shape['steps']} steps (medians of steps 2..{shape['steps']}); generation: "
             "the stand-in. The 2-GPU comparison has not been run.", "",
             "| configuration | launcher | exit | step s (TRL) | fwd+bwd s | MFU % (fwd+bwd) | adapters loaded | "
             "final adapter |", "|---|---|---|---|---|---|---|---|"]
    for r in report["configs"]:
        launched = "world_size=1 sharding=fsdp2" if r["launcher"] and "fsdp2" in r["launcher"][0] else \
            ("yes" if r["launcher"] else "no (one process)")
        lines.append(f"| {r['name']} | {launched} | {r['exit_code']} | {_med(r, 'perf/step_s')} | "
                     f"{_med(r, 'perf/fwd_bwd_s')} | {_med(r, 'perf/mfu_fwd_bwd')} | {r['adapter_loads']} | "
                     f"{'yes' if r['final_adapter'] else 'no'} |")
    if report.get("resume"):
        res = report["resume"]
        lines += ["", f"SIGTERM + restart ({res['name']}): stop exit {res['stopped']['exit_code']}, checkpoints "
                  f"{', '.join(res['checkpoints_after_stop']) or 'none'}, restart exit {res['restarted']['exit_code']}"
                  f", resumed: {'yes' if res['resumed'] else 'no'}, final adapter: "
                  f"{'yes' if res['final_adapter'] else 'no'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/bench-launcher.json")
    parser.add_argument("--work", default="results/bench-launcher-work")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: tiny model, 2 DDP ranks vs one process")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--config-timeout", type=float, default=240.0)
    parser.add_argument("--resume", action="store_true", help="also SIGTERM + restart the first configuration")
    parser.add_argument("--table", metavar="JSON", help="print the README rows of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["LORAFLEET_ENV_FILE"] = ""
    workload = build_workload(work, args.tiny)
    runs = CPU_RUNS if args.tiny else GPU_RUNS
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/launcher_bench.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **environment(),
        "shape": {"model": "tiny" if args.tiny else "Qwen2.5-Math-1.5B (random weights)", "steps": args.steps,
                  "token_budget": args.token_budget, "accumulation": args.accumulation,
                  "lora": "r=1 alpha=2 all-linear (math recipe)"},
        "configs": [], "resume": None,
    }
    out = Path(args.out)
    for name, extra in runs.items():
        report["configs"].append(run_config(name, extra, workload, work, args))
        write_result(out, report)
        print(f"[bench-launcher] {name}: {json.dumps(report['configs'][-1])[:600]}", flush=True)
    if args.resume:
        name, extra = next(iter(runs.items()))
        report["resume"] = resume_check(name, extra, workload, work, args)
        write_result(out, report)
    print(table(report))
    return 0 if all(r["exit_code"] == 0 for r in report["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
