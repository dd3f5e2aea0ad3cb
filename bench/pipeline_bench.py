"""The whole async GRPO loop through the proxy against TRL alone, side by side in one run (issue 44); writes
bench/results/bench-pipeline.json.

The trainer of the first arms is TRL's AsyncGRPOTrainer as `lorafleet-train` builds it (`build_trainer`: the task,
LoRA, the config), trained with TRL's own VLLMClient and rollout worker (`--trl-alone`, trl_alone below), on the same
task, seed and step count; only TRAINER_VLLM_URL differs:

- trl: straight at one replica's own vLLM server, no proxy (TRL alone);
- proxy-1: the real `lorafleet-proxy` in front of that same replica;
- proxy-N: the real `lorafleet-proxy` in front of `--replicas` replicas (the first one among them);
- proxy-1-broadcast: proxy-1 with PROXY_SYNC_PAUSE=broadcast (where a sync's time goes);
- lorafleet-1: `lorafleet-train` itself through the proxy on the first replica (`--no-lorafleet-train`: left out).

So the proxy is the one difference between `trl` and `proxy-1`: both send the same requests from the same client
code. (`lorafleet-train` cannot be TRL alone: its doctor refuses a plain vLLM server, which has no /fleet.) Every
proxy has its defaults but PROXY_SETTINGS. The arms alternate (forward, then backward, ...) for `--repeats` rounds
against replicas started once, after an unmeasured warm-up, so a drift of the machine falls on every arm. Before
each arm every replica's prefix cache is emptied and its policy adapters unloaded; each arm has a fresh ADAPTER_ROOT
(run folder, proxy ledger).

Measured per arm, over its training window (the first logged optimizer step to the last, the trainer's own clock):
optimizer steps per hour; completions per second (the replicas' own `vllm:request_success_total`, read whenever the
step count changes); and from the trainer's metrics the time per step spent in forward/backward, waiting for
rollouts and syncing the adapter. Startup (model load, preflight, the doctor) is reported as wall time apart. The
headline: proxy-1's steps per hour over trl's, and the proxy's share of the difference, 1 - that ratio.

    .venv/bin/python bench/pipeline_bench.py --out bench/results/bench-pipeline.json [--replicas 2 --steps 20 \
        --repeats 2 --shape tiny]

`--shape reference` runs on one GPU (gpu_fleet.layout: the replicas and the trainer share the card), with only the
arms named (`--arms`), extra settings (`--setting KEY=VALUE`); bench/gpu_bench.py runs it so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from gpu_fleet import DEVICES, layout, running, unavailable
from hotpath_bench import cpu_s, reset_prefix_caches, started
from lorafleet.vllm_api import VLLMClient, metric_total
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, proxy_service, replica_service, trainer_service
from trainer_shape import build_workload

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.98  # proxy-1's optimizer steps per hour, as a fraction of TRL alone's
COMPLETIONS = "vllm:request_success_total"
RUN = "bench"
WARMUP_STEPS = 4
# Of the card, where the trainer shares one GPU with the replica: the reference step peaks near 60 GiB without
# gradient checkpointing (bench-trainer), so the replica gets the rest (placement's budget less this).
TRAINER_RESERVE = 0.7
STALL_S = 600.0  # an arm with no new optimizer step for this long has failed (its start included)
# Per-step times the trainer logs (TRL's names): where a step's time goes.
STEP_TIMES = ("perf/step_s", "perf/fwd_bwd_s", "perf/rollout_wait_s", "perf/weight_sync_s")
BATCH_SIZES = ("batch/samples_per_step", "batch/forwarded_tokens_per_step")  # what a step trained


@dataclass(frozen=True)
class Shape:
    """What one optimizer step trains, as settings every process gets."""

    name: str
    settings: dict[str, str]  # the environment of replicas, proxy and trainer
    replica_settings: dict[str, str]
    gpu: bool


SHAPES = {
    # The offline tiny model on the `tiny` task with its own defaults (32 samples of 4 generated tokens per step, a
    # sync every step): what 2 CPU cores train in minutes.
    "tiny": Shape("tiny", {"TRAINER_TASK": "tiny", "MAX_MODEL_LEN": "512"}, {"VLLM_DTYPE": "float32"}, gpu=False),
    # The published run's shape: the settings' defaults (16,384-token micro-batches, 6 per step, the fast step) on
    # the math task, with Qwen2.5-Math-1.5B's architecture in random weights and offline problems (--workload,
    # trainer_shape.build_workload), the replicas and the trainer sharing one GPU (gpu_fleet.layout).
    "reference": Shape("reference", {"TRAINER_TASK": "math"}, {}, gpu=True),
}


@dataclass(frozen=True)
class Arm:
    name: str
    proxy: bool
    replicas: int  # the first `replicas` of the started ones
    lorafleet_train: bool = False  # the trainer: `lorafleet-train` itself, else TRL's own (trl_alone)
    sync_pause: str = "elide"  # the proxy's PROXY_SYNC_PAUSE (elide: its default)


# Every proxy arm: the proxy's defaults but for its periodic canary rounds, which TRL alone has no counterpart of:
# the arms compare the data path. The canary run at every load stays.
PROXY_SETTINGS = {"PROXY_CANARY_INTERVAL_S": "0"}


def arms_for(replicas: int, lorafleet_train: bool = True) -> list[Arm]:
    """trl and proxy-1 on the first replica, proxy-N on all of them (N > 1), then on the first replica again:
    proxy-1 with PROXY_SYNC_PAUSE=broadcast (a sync pauses the replica, as TRL alone's does, and the load's canary
    probe waits for the next round) and `lorafleet-train` itself through the proxy (lorafleet-1)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    arms = [Arm("trl", proxy=False, replicas=1), Arm("proxy-1", proxy=True, replicas=1)]
    if replicas > 1:
        arms.append(Arm(f"proxy-{replicas}", proxy=True, replicas=replicas))
    arms.append(Arm("proxy-1-broadcast", proxy=True, replicas=1, sync_pause="broadcast"))
    return arms + ([Arm("lorafleet-1", proxy=True, replicas=1, lorafleet_train=True)] if lorafleet_train else [])


def pick_arms(arms: list[Arm], names: list[str]) -> list[Arm]:
    """The arms named, in the order named (the first runs first); all of them where none is named."""
    known = {arm.name: arm for arm in arms}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(known)}")
    return [known[name] for name in names] if names else arms


def arm_order(arms: list[Arm], repeats: int) -> list[tuple[int, Arm]]:
    """(round, arm) in the order they run: the arms forward in even rounds, backward in odd ones (A B C C B A ...),
    so a load that rises or falls through the run weighs on every arm alike."""
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    return [(round_, arm) for round_ in range(repeats) for arm in (arms if round_ % 2 == 0 else arms[::-1])]


@dataclass
class ArmRun:
    """One arm's training, as measured."""

    arm: str
    round: int
    steps: int  # optimizer steps inside the training window (first logged step excluded: it opens the window)
    train_s: float  # the trainer's clock from the first logged step to the last
    completions: float  # completions the arm's replicas finished in the window
    window_s: float  # the window over which `completions` were counted (this process's clock)
    wall_s: float  # the trainer process, start to exit (model load, preflight and the doctor included)
    step_times: dict[str, float | None]  # mean seconds per step of each of STEP_TIMES
    per_step: dict[str, float | None]  # mean samples and tokens per step (BATCH_SIZES)
    proxy_cpu_s: float | None  # the proxy process's CPU time over the arm (None: no proxy)


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows of optimizer steps (TRL logs a reward with each), in step order."""
    return sorted((row for row in rows if "reward" in row and "time" in row), key=lambda row: int(row["step"]))


def window(rows: list[dict[str, Any]]) -> tuple[int, float]:
    """(steps, seconds) from the first optimizer step's row to the last: the first step (the rollout worker's start,
    the first generations) only opens the window."""
    timed = step_rows(rows)
    if len(timed) < 2:
        raise ValueError(f"at least two optimizer steps are needed to time a window, got {len(timed)}")
    return int(timed[-1]["step"]) - int(timed[0]["step"]), float(timed[-1]["time"]) - float(timed[0]["time"])


def step_means(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float | None]:
    """Mean per step of each of `keys` over the rows that logged it."""
    return {key: _mean([float(row[key]) for row in rows if isinstance(row.get(key), int | float)]) for key in keys}


def arm_summary(runs: list[ArmRun]) -> dict[str, Any]:
    """One arm over its rounds: rates pooled (all steps over all seconds), per-step times averaged, the rounds' own
    steps per hour listed (their spread is the run's noise)."""
    steps, train_s = sum(run.steps for run in runs), sum(run.train_s for run in runs)
    completions, window_s = sum(run.completions for run in runs), sum(run.window_s for run in runs)
    step_times = {key: _mean([v for run in runs if (v := run.step_times.get(key)) is not None]) for key in STEP_TIMES}
    cpu = [run.proxy_cpu_s for run in runs if run.proxy_cpu_s is not None]
    return {
        "rounds": len(runs),
        "steps_per_hour": round(3600 * steps / train_s, 1) if train_s else None,
        "steps_per_hour_by_round": [round(3600 * run.steps / run.train_s, 1) if run.train_s else None for run in runs],
        "rollouts_per_s": round(completions / window_s, 2) if window_s else None,
        "train_s": round(train_s, 1),
        "wall_s": round(sum(run.wall_s for run in runs), 1),
        "step_times_s": step_times,
        "proxy_cpu_s_per_step": round(sum(cpu) / steps, 4) if cpu and steps else None,
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def comparison(alone: float, proxied: float) -> dict[str, float]:
    """`proxied` against `alone` (steps per hour): their ratio, and the proxy's share of the difference,
    (alone - proxied) / alone (negative: the proxied arm was faster)."""
    if alone <= 0 or proxied < 0:
        raise ValueError(f"rates must be positive: alone {alone}, proxied {proxied}")
    return {"ratio": round(proxied / alone, 4), "proxy_share": round((alone - proxied) / alone, 4)}


def headline(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every arm against TRL alone, and whether proxy-1 met GOAL."""
    alone = arms["trl"]["steps_per_hour"]
    versus = {name: comparison(alone, arm["steps_per_hour"]) for name, arm in arms.items() if name != "trl"}
    return {"goal": GOAL, "vs_trl": versus, "goal_met": versus["proxy-1"]["ratio"] >= GOAL}


RESULT_KEYS = {"benchmark", RECORD_KEY, "shape", "parameters", "order", "arms", "headline"}
ARM_KEYS = {"rounds", "steps_per_hour", "steps_per_hour_by_round", "rollouts_per_s", "train_s", "wall_s",
            "step_times_s", "proxy_cpu_s_per_step"}


def check_result(result: dict[str, Any]) -> None:
    """Raise ValueError unless `result` has the layout the docs page renders (top-level keys, each arm's keys, the
    headline's ratio)."""
    missing = RESULT_KEYS - set(result)
    if missing:
        raise ValueError(f"result lacks {sorted(missing)}")
    for name, arm in result["arms"].items():
        if set(arm) != ARM_KEYS:
            raise ValueError(f"arm {name} has keys {sorted(arm)}, expected {sorted(ARM_KEYS)}")
    if "trl" not in result["arms"] or "proxy-1" not in result["arms"]:
        raise ValueError("result lacks the trl or the proxy-1 arm")
    if not isinstance(result["headline"].get("vs_trl", {}).get("proxy-1", {}).get("ratio"), float):
        raise ValueError("result's headline has no ratio of proxy-1 against trl")


# --- running it -----------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completions_done(urls: list[str]) -> float:
    return sum(metric_total(httpx.get(url + "/metrics", timeout=30).text, COMPLETIONS) for url in urls)


async def _unload_policies(urls: list[str]) -> None:
    from lorafleet_trainer.fleet_preflight import sweep_policies

    for url in urls:
        async with VLLMClient(url) as client:
            await sweep_policies(client)


def fresh_replicas(urls: list[str]) -> None:
    """Every replica as a new one would be: no policy adapter loaded, an empty prefix cache."""
    asyncio.run(_unload_policies(urls))
    if not reset_prefix_caches(urls):
        raise RuntimeError(f"a replica refused to reset its prefix cache: {', '.join(urls)}")


def trainer_process(name: str, arm: Arm, env: dict[str, str], log_dir: Path) -> Service:
    """`lorafleet-train`, or TRL's own trainer and client (this file, --trl-alone) told the arm's replica count."""
    if arm.lorafleet_train:
        return trainer_service(name, env, log_dir)
    return Service(name, [sys.executable, str(Path(__file__).resolve()), "--trl-alone"],
                   {**os.environ, **env, "TRAINER_REPLICAS": str(arm.replicas)}, log_dir / f"{name}.log")


def run_arm(arm: Arm, round_: int, replicas: list[Service], settings: dict[str, str], steps: int,
            work: Path) -> ArmRun:
    """One arm in round `round_` (-1: the warm-up): a fresh ADAPTER_ROOT, the proxy if the arm has one, the
    trainer until it exits."""
    urls = [replica.url for replica in replicas[: arm.replicas]]
    fresh_replicas([replica.url for replica in replicas])
    root = work / f"{round_}-{arm.name}"
    shutil.rmtree(root, ignore_errors=True)
    env = {**settings, "ADAPTER_ROOT": str(root), "RUN_NAME": RUN, "MAX_STEPS": str(steps), "EVAL_EVERY_STEPS": "0",
           "TRAINER_METRICS_PORT": "0"}
    proxy_env = {**env, **PROXY_SETTINGS, "PROXY_SYNC_PAUSE": arm.sync_pause, "PROXY_UPSTREAMS": ",".join(urls)}
    proxy = proxy_service(f"proxy-{round_}-{arm.name}", proxy_env, work / "logs") if arm.proxy else None
    with started([proxy] if proxy else [], timeout_s=60):
        trainer = trainer_process(f"trainer-{round_}-{arm.name}", arm,
                                  {**env, "TRAINER_VLLM_URL": proxy.url if proxy else urls[0]}, work / "logs")
        cpu_before = cpu_s(proxy.pid) if proxy else None
        began = time.monotonic()
        trainer.start()
        metrics = root / "runs" / RUN / "metrics.jsonl"
        seen, first, last = 0, None, None  # (monotonic time, completions) at the first and the last step seen
        progress = began
        try:
            while trainer.alive:
                time.sleep(0.5)
                count = sum(1 for row in read_rows(metrics) if "reward" in row)
                if count != seen:
                    seen, last = count, (time.monotonic(), completions_done(urls))
                    first, progress = first or last, last[0]
                elif time.monotonic() - progress > STALL_S:  # e.g. TRL's rollout worker died: TRL waits for it
                    raise RuntimeError(f"arm {arm.name}: no optimizer step for {STALL_S:.0f}s (step {seen}):\n"
                                       f"{trainer.log_tail(60)}")
            wall_s = time.monotonic() - began
            proxy_cpu = cpu_s(proxy.pid) - cpu_before if proxy and cpu_before is not None else None
        finally:
            trainer.stop()
    assert trainer.process is not None
    if trainer.process.returncode != 0:
        raise RuntimeError(f"arm {arm.name}: the trainer failed (exit {trainer.process.returncode}):\n"
                           f"{trainer.log_tail(60)}")
    rows = step_rows(read_rows(metrics))
    trained, train_s = window(rows)
    if first is None or last is None or last[0] <= first[0]:
        raise RuntimeError(f"arm {arm.name}: the training window was too short to count completions in")
    return ArmRun(arm.name, round_, trained, train_s, last[1] - first[1], last[0] - first[0], wall_s,
                  step_means(rows[1:], STEP_TIMES), step_means(rows[1:], BATCH_SIZES),
                  round(proxy_cpu, 2) if proxy_cpu is not None else None)


def trl_alone() -> int:
    """TRL's AsyncGRPOTrainer as lorafleet-train builds it (`build_trainer`: the task, LoRA, the config), trained
    with TRL's own VLLMClient and rollout worker as they ship: none of lorafleet-train's preflight, doctor, run key,
    fleet wait or guards. Settings from the environment, as lorafleet-train reads them; TRAINER_REPLICAS is given."""
    from lorafleet_trainer.attention import choose_backend
    from lorafleet_trainer.config import build_configs
    from lorafleet_trainer.main import build_trainer, cuda_devices, install_kernels, resolve_settings
    from lorafleet_trainer.ranks import plan_ranks
    from lorafleet_trainer.run_state import MetricsJsonl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # as lorafleet-train does
    settings = resolve_settings({})
    devices = cuda_devices()
    configs = build_configs(settings, replicas=settings.trainer_replicas, ranks=plan_ranks(settings, devices))
    install_kernels(settings, choose_backend(settings.trainer_attention, cuda=devices > 0).backend, cuda=devices > 0)
    build_trainer(settings, configs, [MetricsJsonl(settings.metrics_path)]).train()
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    device = args.device or ("gpu" if shape.gpu else "cpu")
    reason = unavailable() if device == "gpu" else None
    if reason:
        raise SystemExit(f"pipeline_bench: --device gpu: {reason}")
    arms = pick_arms(arms_for(args.replicas, args.lorafleet_train), args.arms)
    order = arm_order(arms, args.repeats)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    fleet = layout(device, args.replicas, eager=not args.cuda_graphs, trainer_reserve=TRAINER_RESERVE)
    settings = {**shape.settings, "LOG_LEVEL": "WARNING", "SEED": str(args.seed), **fleet.trainer_env,
                **dict(item.split("=", 1) for item in args.setting)}
    if shape.name == "tiny":
        from lorafleet_ops.tiny_model import make_tiny_model

        settings["BASE_MODEL"] = str(make_tiny_model(work / "tiny"))
    else:  # a small CPU smoke of the reference path builds the tiny shape
        workload = build_workload((args.workload or work / "workload").resolve(), tiny=device == "cpu")
        settings.update(BASE_MODEL=workload["model_dir"], DATASET_PATH=workload["dataset"])
    replica_env = {**settings, **shape.replica_settings, **fleet.replica_env, "ADAPTER_ROOT": str(work / "replicas")}
    replicas = [replica_service(f"replica-{i + 1}", replica_env, work / "logs") for i in range(args.replicas)]
    runs: list[ArmRun] = []
    warmup: ArmRun | None = None
    print(f"==> {args.replicas} replicas starting on {device}; logs in {work / 'logs'}", flush=True)
    with running(replicas, fleet.wave, timeout_s=600):
        if args.warmup_steps:  # unmeasured: vLLM's first batches on CPU (base and LoRA) compile for seconds
            warm = max(arms, key=lambda arm: (arm.replicas, arm.proxy))
            print(f"==> warm-up: {warm.name}, {args.warmup_steps} steps", flush=True)
            warmup = run_arm(warm, -1, replicas, settings, args.warmup_steps, work)
        for round_, arm in order:
            print(f"==> round {round_ + 1}/{args.repeats}: {arm.name}", flush=True)
            done = run_arm(arm, round_, replicas, settings, args.steps, work)
            print(f"    {done.steps} steps in {done.train_s:.1f}s ({3600 * done.steps / done.train_s:.0f}/h), "
                  f"{done.completions / done.window_s:.1f} completions/s, wall {done.wall_s:.0f}s", flush=True)
            runs.append(done)
    shutil.rmtree(work, ignore_errors=True)
    summaries = {arm.name: arm_summary([run for run in runs if run.arm == arm.name]) for arm in arms}
    return {
        "benchmark": "pipeline",
        RECORD_KEY: run_record(),
        "shape": {"name": shape.name, **shape.settings, "steps": args.steps, **per_step(runs)},
        "parameters": {"replicas": args.replicas, "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
                       "lorafleet_train": args.lorafleet_train, "proxy_settings": PROXY_SETTINGS,
                       "device": device, "warmup_steps": args.warmup_steps, "settings": args.setting,
                       "replica_settings": fleet.notes},
        "order": [f"{round_}:{arm.name}" for round_, arm in order],
        "arms": summaries,
        "runs": [{**asdict(run), "steps_per_hour": round(3600 * run.steps / run.train_s, 1)} for run in runs],
        "warmup": asdict(warmup) if warmup else None,
        "headline": headline(summaries),
    }


def per_step(runs: list[ArmRun]) -> dict[str, float | None]:
    """What one step trained, over every arm (the same task and seed: the same shape in each)."""
    return {key.removeprefix("batch/"): _mean([v for run in runs if (v := run.per_step.get(key)) is not None])
            for key in BATCH_SIZES}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench-pipeline.json")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the proxy-N arm (N)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps each arm trains")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all the arms, alternating their order")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lorafleet-train", action=argparse.BooleanOptionalAction, default=True,
                        help="the lorafleet-1 arm: lorafleet-train itself through the proxy")
    parser.add_argument("--device", choices=DEVICES, help="where the replicas and trainer run (default: the shape's)")
    parser.add_argument("--workload", type=Path, help="reference shape: the folder its model and problems are built "
                        "in, or were (trainer_shape.build_workload; default: a temporary one)")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=[],
                        help="only these arms, in this order, comma-separated (default: all; needs trl and proxy-1)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="unmeasured steps first (0: none)")
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting every process gets (repeatable), e.g. MAX_COMPLETION_LENGTH=512")
    parser.add_argument("--cuda-graphs", action="store_true", help="GPU replicas with CUDA graphs (default: eager)")
    parser.add_argument("--trl-alone", action="store_true", help=argparse.SUPPRESS)  # an arm's trainer (trl_alone)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_alone:
        return trl_alone()
    if args.steps < 3:
        print("pipeline_bench: --steps must be at least 3 (the window opens at the first step)", file=sys.stderr)
        return 2
    result = run(args)
    check_result(result)
    write_result(args.out, result)
    ratio = result["headline"]["vs_trl"]["proxy-1"]["ratio"]
    print(f"proxy-1 / trl: {ratio:.3f} (goal {GOAL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
