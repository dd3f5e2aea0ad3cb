"""Routing and overhead benchmark of lorafleet-proxy on a GRPO-shaped trace against fake replicas.

Three processes, as deployed: fake vLLM replicas (lorafleet_testing.fakes in tests/support, a never-evicting prefix
cache each, a small simulated latency), the real `lorafleet-proxy` console script, and this load
generator. The trace: prompts = a shared chat-template prefix + a problem, as token ids; 8 rollouts
per prompt sent concurrently; hundreds of requests in flight; a new policy version (pause, load,
resume, unload) every few hundred rollouts, as TRL's adapter-only sync does.

For each routing mode it reports the router's affinity / spilled / unmatched fractions, the prefix
cache hit rate the fake replicas actually saw, requests/s and latency; the same trace sent straight
to the replicas (round robin) gives the latency the proxy adds. Writes JSON to --out.

    .venv/bin/python bench/proxy_bench.py --out bench/results/bench-proxy.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
from lorafleet.ports import free_port
from lorafleet.vllm_api import replica_limits
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import script
from lorafleet_proxy.router import Router
from lorafleet_testing.fakes import FakeReplica, start_server

ROOT = Path(__file__).resolve().parents[1]

MODEL = "fake-base"


# --- fake replicas (child process) --------------------------------------------------------------
async def serve_fakes(count: int, latency_ms: float, jitter_ms: float, block_size: int) -> None:
    fakes = [FakeReplica(block_size=block_size) for _ in range(count)]
    for fake in fakes:
        fake.faults.latency_s, fake.faults.latency_jitter_s = latency_ms / 1000, jitter_ms / 1000
    servers = [await start_server(fake.app()) for fake in fakes]
    for fake, server in zip(fakes, servers, strict=True):
        fake.url = server.url
    print(json.dumps([server.url for server in servers]), flush=True)
    await asyncio.Event().wait()


# --- trace ---------------------------------------------------------------------------------------
def make_trace(args: argparse.Namespace) -> list[list[int]]:
    """One token prompt per group: the shared template, then the problem (vocabulary-sized random ids)."""
    rng = random.Random(args.seed)
    template = [rng.randrange(1000) for _ in range(args.template_tokens)]
    return [template + [rng.randrange(1000) for _ in range(rng.randint(args.min_problem, args.max_problem))]
            for _ in range(args.prompts)]


async def run_trace(base_urls: list[str], prompts: list[list[int]], args: argparse.Namespace,
                    proxy: bool) -> dict[str, Any]:
    """Send every group's rollouts concurrently, at most `inflight` at once; sync versions through the proxy."""
    groups = asyncio.Semaphore(max(args.inflight // args.rollouts, 1))  # the trainer's in-flight cap
    latencies: list[float] = []
    errors = 0
    version = {"n": 0}
    limits = replica_limits(max_connections=args.inflight + 8, max_keepalive_connections=args.inflight + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def sync() -> None:
            new = version["n"] + 1
            path = f"{args.adapter_root}/runs/bench/.vllm_lora/trl-policy-v{new}"
            await client.post(base_urls[0] + "/pause", params={"mode": "keep"})
            load = await client.post(base_urls[0] + "/v1/load_lora_adapter",
                                     json={"lora_name": f"trl-policy-v{new}", "lora_path": path})
            load.raise_for_status()
            version["n"] = new
            await client.post(base_urls[0] + "/resume")
            if new - args.max_staleness - 1 > 0:
                await client.post(base_urls[0] + "/v1/unload_lora_adapter",
                                  json={"lora_name": f"trl-policy-v{new - args.max_staleness - 1}"})

        async def rollout(index: int, prompt: list[int], model: str) -> None:
            nonlocal errors
            url = base_urls[index % len(base_urls)]
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "n": 1, "return_token_ids": True,
                    "logprobs": 0, "seed": index}
            started = time.perf_counter()
            try:
                response = await client.post(url + "/v1/completions", json=body)
                errors += response.status_code != 200
            except httpx.TransportError:
                errors += 1
            latencies.append(time.perf_counter() - started)

        async def group(index: int, prompt: list[int], model: str) -> None:
            try:
                await asyncio.gather(*(rollout(index * args.rollouts + k, prompt, model)
                                       for k in range(args.rollouts)))
            finally:
                groups.release()

        if proxy:
            await sync()
        tasks = []
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            if proxy and index and index % args.sync_every == 0:
                await sync()
            model = f"trl-policy-v{version['n']}" if proxy else MODEL
            await groups.acquire()
            tasks.append(asyncio.create_task(group(index, prompt, model)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return {"requests": len(latencies), "errors": errors, "wall_s": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 1), **latency_ms(latencies)}


async def latency_probe(base_urls: list[str], prompts: list[list[int]], model: str,
                        args: argparse.Namespace) -> dict[str, float]:
    """Light load (a few requests in flight): the latency the proxy adds, not the box's CPU contention."""
    latencies: list[float] = []
    gate = asyncio.Semaphore(args.probe_concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(index: int) -> None:
            body = {"model": model, "prompt": prompts[index % len(prompts)], "max_tokens": 16}
            async with gate:
                started = time.perf_counter()
                response = await client.post(base_urls[index % len(base_urls)] + "/v1/completions", json=body)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()

        await asyncio.gather(*(one(index) for index in range(args.probe_requests)))
    return latency_ms(latencies)


def latency_ms(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 2)}


async def prefix_cache_hit_frac(fake_urls: list[str]) -> float:
    """Blocks found in the fake replicas' prefix caches over blocks they were sent, all replicas together."""
    async with httpx.AsyncClient() as client:
        stats = [(await client.get(url + "/fake_stats")).json() for url in fake_urls]
    hits, blocks = (sum(s[key] for s in stats) for key in ("hit_blocks", "prompt_blocks"))
    return round(hits / max(blocks, 1), 4)


# --- orchestration -------------------------------------------------------------------------------
def start_fakes(args: argparse.Namespace) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, __file__, "--serve-fakes", str(args.replicas), "--latency-ms",
                              str(args.latency_ms), "--jitter-ms", str(args.jitter_ms), "--block-size",
                              str(args.block_size)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (the box is shared: CPU per request is the stable number)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


async def bench_mode(mode: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    fakes, fake_urls = start_fakes(args)
    port = free_port()
    env = {**os.environ, "PROXY_UPSTREAMS": ",".join(fake_urls), "PROXY_PORT": str(port), "PROXY_API_KEY": "",
           "PROXY_FLEET_HOST": "127.0.0.1", "PROXY_ROUTING": mode, "ADAPTER_ROOT": args.adapter_root,
           "PROXY_HEALTH_INTERVAL_S": "1", "LOG_LEVEL": "WARNING", "PROXY_IMBALANCE": str(args.imbalance)}
    proxy = subprocess.Popen([script("lorafleet-proxy")], env=env, cwd=args.adapter_root)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.05)
        cpu_before = cpu_seconds(proxy.pid)
        result = await run_trace([url], prompts, args, proxy=True)
        cpu = cpu_seconds(proxy.pid) - cpu_before
        async with httpx.AsyncClient() as client:
            router = (await client.get(url + "/fleet")).json()["router"]
        hit_frac = await prefix_cache_hit_frac(fake_urls)
        result["light_load"] = await latency_probe([url], prompts, MODEL, args)
        routed = router["routed"]
        result |= {
            "routing": mode, "router": router,
            "affinity_frac": round(router["affinity"] / routed, 4),
            "spilled_frac": round(router["spilled"] / routed, 4),
            "unmatched_frac": round(router["unmatched"] / routed, 4),
            "prefix_cache_hit_frac": hit_frac,
            "proxy_peak_rss_mib": peak_rss_mib(proxy.pid),
            "proxy_cpu_ms_per_request": round(1000 * cpu / result["requests"], 3),
        }
        return result
    finally:
        proxy.terminate()
        proxy.wait(timeout=15)
        fakes.kill()
        fakes.wait()


def router_memory(blocks: int = 200_000) -> dict[str, float]:
    """Bytes per routing-table entry with the table full (PROXY_MAX_TRACKED_BLOCKS' default)."""
    rng = random.Random(1)
    router = Router(block_size=16, max_blocks=blocks)
    tracemalloc.start()
    for index in range(blocks // 20 + 100):
        prompt = [rng.randrange(1000) for _ in range(16 * 20)]
        router.choose("v1", router.prompt_blocks({"model": "v1", "prompt": prompt}), {"a": index % 3, "b": 1})
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"tracked_blocks": router.tracked_blocks, "bytes_per_block": round(used / router.tracked_blocks, 1),
            "table_mib": round(used / 2**20, 1)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_trace(args)
    fakes, fake_urls = start_fakes(args)
    try:
        direct = await run_trace(fake_urls, prompts, args, proxy=False)
        direct["prefix_cache_hit_frac"] = await prefix_cache_hit_frac(fake_urls)
        direct["light_load"] = await latency_probe(fake_urls, prompts, MODEL, args)
    finally:
        fakes.kill()
        fakes.wait()
    modes = {mode: await bench_mode(mode, args, prompts) for mode in args.modes.split(",")}
    main = modes.get("affinity") or next(iter(modes.values()))
    memory = router_memory()
    return {
        "trace": {key: getattr(args, key) for key in ("replicas", "prompts", "rollouts", "inflight", "template_tokens",
                                                       "min_problem", "max_problem", "block_size", "latency_ms",
                                                       "jitter_ms", "sync_every", "imbalance", "seed", "probe_requests",
                                                       "probe_concurrency")},
        "direct_round_robin": direct,
        "modes": modes,
        "router_memory": memory,
        "summary": {
            "unmatched_frac": main["unmatched_frac"], "affinity_frac": main["affinity_frac"],
            "spilled_frac": main["spilled_frac"], "unmatched_floor": round(1 / args.rollouts, 4),
            "prefix_cache_hit_frac": main["prefix_cache_hit_frac"],
            "proxy_requests_per_s": main["requests_per_s"],
            "added_p50_ms_light_load": round(main["light_load"]["p50_ms"] - direct["light_load"]["p50_ms"], 2),
            "added_p99_ms_light_load": round(main["light_load"]["p99_ms"] - direct["light_load"]["p99_ms"], 2),
            "added_p50_ms_trace": round(main["p50_ms"] - direct["p50_ms"], 2),
            "added_p99_ms_trace": round(main["p99_ms"] - direct["p99_ms"], 2),
            "proxy_peak_rss_mib": main["proxy_peak_rss_mib"],
            "proxy_cpu_ms_per_request": main["proxy_cpu_ms_per_request"],
            "router_bytes_per_block": memory["bytes_per_block"],
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench-proxy.json")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=600, help="GRPO groups (prompts) in the trace")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt, sent concurrently")
    parser.add_argument("--inflight", type=int, default=256, help="requests in flight at most (trainer cap)")
    parser.add_argument("--template-tokens", type=int, default=40, help="shared chat-template prefix length")
    parser.add_argument("--min-problem", type=int, default=40)
    parser.add_argument("--max-problem", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size the fake replicas report")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--jitter-ms", type=float, default=40.0)
    parser.add_argument("--sync-every", type=int, default=64, help="groups between policy versions")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--imbalance", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-requests", type=int, default=400, help="light-load latency probe: requests")
    parser.add_argument("--probe-concurrency", type=int, default=4, help="light-load latency probe: in flight")
    parser.add_argument("--modes", default="affinity,least_loaded,round_robin")
    parser.add_argument("--serve-fakes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.serve_fakes:
        asyncio.run(serve_fakes(args.serve_fakes, args.latency_ms, args.jitter_ms, args.block_size))
        return
    with tempfile.TemporaryDirectory() as root:
        args.adapter_root = root
        result = asyncio.run(bench(args))
    write_result(args.out, {RECORD_KEY: run_record(), **result}, shown=result["summary"])
    for mode, row in result["modes"].items():
        print(f"{mode:>13}: unmatched {row['unmatched_frac']:.1%} affinity {row['affinity_frac']:.1%} "
              f"spilled {row['spilled_frac']:.1%} cache-hit {row['prefix_cache_hit_frac']:.1%} "
              f"{row['requests_per_s']} req/s p50 {row['p50_ms']} ms p99 {row['p99_ms']} ms "
              f"errors {row['errors']} rss {row['proxy_peak_rss_mib']} MiB "
              f"cpu {row['proxy_cpu_ms_per_request']} ms/req")
    direct = result["direct_round_robin"]
    print(f"{'direct':>13}: {direct['requests_per_s']} req/s p50 {direct['p50_ms']} ms p99 {direct['p99_ms']} ms "
          f"cache-hit {direct['prefix_cache_hit_frac']:.1%}; written to {args.out}")


if __name__ == "__main__":
    main()
