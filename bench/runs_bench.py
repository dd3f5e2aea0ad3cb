"""Several runs saturating one fleet (issue 24): throughput share per run against its weight, queue wait, and
the fleet's total against a single run alone, side by side in one process; writes bench/results/bench-runs.json.

Two fake replicas (lorafleet_testing.fakes in tests/support: real HTTP, an engine that runs `--window` completions
at once, each taking `--latency-s` and generating 3 tokens) behind the real proxy app with
PROXY_FAIR_INFLIGHT_PER_REPLICA = that batch (and the default PROXY_FAIR_PIPELINE_PER_REPLICA), so the fleet, not
the load generator, is the bottleneck, and one run alone gets the same fleet. Each run has its own adapter and a
closed loop of clients; client counts differ on purpose (one run bursts), so a share that follows the weights comes
from the proxy's queue, not from the load. Scenarios: one run alone (the default run), two runs (weights 1:1,
clients 3:1), four runs (weights 1:1:2:4, equal clients). Shares are counted in generated tokens from the proxy's
GET /fleet over the saturated window only: from the end of a warm-up (the first window is admitted before anyone
queues) to the moment the clients stop sending (after it, every client's last request drains regardless of weight:
equal counts per client, not the scheduler's choice). Queue wait percentiles come from the proxy's
`lorafleet_proxy_run_queue_wait_seconds` histogram.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.settings import load_settings
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import FakeReplica, start_server, weights_file
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

TOKENS_PER_COMPLETION = 3  # what a fake replica generates for each completion (fakes.py)
SCENARIOS: dict[str, dict[str, tuple[float, int]]] = {  # run -> (weight, clients)
    "one run alone": {"default": (1.0, 48)},
    "two runs, one bursting": {"a": (1.0, 48), "b": (1.0, 16)},
    "four runs, weights 1:1:2:4": {"a": (1.0, 16), "b": (1.0, 16), "c": (2.0, 16), "d": (4.0, 16)},
}


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """A quantile of a Prometheus histogram (cumulative (le, count) pairs), interpolated inside its bucket."""
    total = buckets[-1][1]
    if not total:
        return 0.0
    rank, previous = q * total, (0.0, 0.0)
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return previous[0]
            share = (rank - previous[1]) / max(count - previous[1], 1e-9)
            return previous[0] + (bound - previous[0]) * share
        previous = (bound, count)
    return previous[0]


def queue_waits(metrics: str) -> dict[str, dict[str, float]]:
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "lorafleet_proxy_run_queue_wait_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets.setdefault(sample.labels["run"], []).append((float(sample.labels["le"]), sample.value))
    return {run: {f"p{q}_ms": round(1000 * quantile(sorted(pairs), q / 100), 2) for q in (50, 99)}
            for run, pairs in buckets.items()}


def run_tokens(view: dict[str, Any]) -> dict[str, int]:
    """Generated tokens per run, as the proxy counted them (GET /fleet's runs)."""
    return {row["run"]: int(row.get("generated_tokens") or 0) for row in view.get("runs", [])}


async def scenario(name: str, runs: dict[str, tuple[float, int]], seconds: float, latency_s: float,
                   window: int, warmup_s: float) -> dict[str, Any]:
    fakes = [FakeReplica(max_loras=16) for _ in range(2)]
    for fake in fakes:  # an engine: `window` completions at once, each `latency_s` long
        fake.faults.latency_s, fake.faults.max_running = latency_s, window
    servers = [await start_server(fake.app()) for fake in fakes]
    for fake, server in zip(fakes, servers, strict=True):
        fake.url = server.url
    root = Path(tempfile.mkdtemp(prefix="bench-runs-"))
    settings = load_settings(proxy_upstreams=",".join(s.url for s in servers), adapter_root=str(root),
                             proxy_fair_inflight_per_replica=window, max_staleness=0, log_level="WARNING")
    proxy = await start_server(create_app(settings))
    http = httpx.AsyncClient(base_url=proxy.url, timeout=60, limits=httpx.Limits(max_connections=None))
    try:
        while not all(r["state"] == "ready" for r in (await http.get("/fleet")).json()["replicas"]):
            await asyncio.sleep(0.05)
        prefix = {run: "" if run == "default" else f"/runs/{run}" for run in runs}
        for run, (weight, _) in runs.items():
            directory = root / "runs" / run / "policy"
            directory.mkdir(parents=True)
            (directory / "adapter_config.json").write_text("{}")
            (directory / "adapter_model.safetensors").write_bytes(weights_file(run.encode()))
            if run != "default":
                await http.post(f"{prefix[run]}/register", json={"max_staleness": 0, "weight": weight})
            response = await http.post(f"{prefix[run]}/v1/load_lora_adapter",
                                       json={"lora_name": "policy", "lora_path": str(directory)})
            assert response.status_code == 200, response.text
        stop = time.monotonic() + seconds
        done: dict[str, int] = dict.fromkeys(runs, 0)

        async def client(run: str, index: int) -> None:
            body = {"model": "policy", "prompt": list(range(index, index + 64)), "max_tokens": TOKENS_PER_COMPLETION}
            while time.monotonic() < stop:
                response = await http.post(f"{prefix[run]}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                done[run] += 1

        async def counted() -> dict[str, int]:
            """Generated tokens per run: the proxy's count (GET /fleet), or, for a lone run (a single-run fleet
            counts no tokens per run), its completions as the clients saw them."""
            proxy = run_tokens((await http.get("/fleet")).json())
            return {run: proxy.get(run) or TOKENS_PER_COMPLETION * done[run] for run in runs}

        async def measured() -> tuple[dict[str, int], dict[str, int], float]:
            """Tokens per run at the end of the warm-up and when the clients stop sending; the seconds between."""
            await asyncio.sleep(max(0.0, stop - seconds + warmup_s - time.monotonic()))
            first, first_at = await counted(), time.monotonic()
            await asyncio.sleep(max(0.0, stop - time.monotonic()))
            return first, await counted(), time.monotonic() - first_at

        loads = asyncio.gather(*(client(run, i) for run, (_, clients) in runs.items() for i in range(clients)))
        (before, after, window_s), _ = await asyncio.gather(measured(), loads)
        waits = queue_waits((await http.get("/metrics")).text)
    finally:
        await http.aclose()
        await proxy.stop()
        for server in servers:
            await server.stop()
    total_weight = sum(weight for weight, _ in runs.values())
    tokens = {run: after.get(run, 0) - before.get(run, 0) for run in runs}
    total_tokens = sum(tokens.values())
    result = {"scenario": name, "measured_s": round(window_s, 1), "warmup_s": warmup_s,
              "pipeline_per_replica": settings.proxy_fair_pipeline_per_replica,
              "requests_per_s": round(total_tokens / TOKENS_PER_COMPLETION / window_s, 1), "runs": []}
    for run, (weight, clients) in runs.items():
        share = tokens[run] / total_tokens if total_tokens else 0.0
        target = weight / total_weight
        result["runs"].append({"run": run, "weight": weight, "clients": clients, "requests": done[run],
                               "generated_tokens": tokens[run], "share": round(share, 4), "target": round(target, 4),
                               "share_vs_target": round(share / target, 3),
                               **waits.get(run, {"p50_ms": 0.0, "p99_ms": 0.0})})
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| scenario | run | weight | clients | requests/s (fleet) | token share | target | share / target | "
             "queue wait p50 / p99 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["runs"]:
            lines.append(f"| {result['scenario']} | {row['run']} | {row['weight']:g} | {row['clients']} | "
                         f"{result['requests_per_s']:,.0f} | {100 * row['share']:.1f}% | {100 * row['target']:.1f}% | "
                         f"{row['share_vs_target']:.3f} | {row['p50_ms']:.1f} / {row['p99_ms']:.1f} |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench-runs.json")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--latency-s", type=float, default=0.2, help="time one fake completion takes")
    parser.add_argument("--window", type=int, default=4, help="PROXY_FAIR_INFLIGHT_PER_REPLICA")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of load before shares are counted")
    args = parser.parse_args()
    results = [await scenario(name, runs, args.seconds, args.latency_s, args.window, args.warmup_s)
               for name, runs in SCENARIOS.items()]
    print(table(results))
    write_result(args.out, {RECORD_KEY: run_record(), "latency_s": args.latency_s,
                            "window_per_replica": args.window, "replicas": 2, "results": results})


if __name__ == "__main__":
    asyncio.run(main())
