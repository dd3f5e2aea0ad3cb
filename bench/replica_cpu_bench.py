"""CPU replica benchmark: vLLM's executor in CPU mode, `uni` (lorafleet's default) vs `mp` (vLLM's own), side by side.

vLLM's CPU platform runs the model in a worker process of its own (`mp`) that busy-polls the engine's shared-memory
queue for a second after every step. On a workstation or CI box where replicas, the trainer and a booting replica
share cores, that spinning is CPU taken from everything else. Per mode, one real `lorafleet-replica` (tiny model)
bound to core 0:

- boot: start to /health 200, the machine otherwise idle;
- CPU used (cores, all of the replica's processes) idle and under light traffic (one 4-token completion every
  0.25 s, the stack test's evaluation traffic), with that traffic's median latency;
- saturated: completions and tokens per second with 8 concurrent clients (32 tokens each);
- streaming: rollouts and streamed tokens per second with 8 concurrent STREAMING completions (48-token prompts,
  64 tokens each, temperature 1), the shape of make bench-sync's rollouts and of the demo's evaluation traffic;
- neighbour boot: a second replica on the SAME core booting while the first serves the light traffic (scale-out or
  a crash restart on a shared machine); null when it was not healthy within --neighbour-timeout.

    .venv/bin/python bench/replica_cpu_bench.py --out bench/results/bench-replica.json

`--variant NAME=EXECUTOR[:VAR=VALUE,...]` adds a configuration measured beside mp and uni in the same rounds (its
variables on top of the replica's environment), e.g. uni as it ran before its OpenMP threads were bound:
`--variant uni-unbound=uni:OMP_NUM_THREADS=2,OMP_PROC_BIND=false`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, replica_service, wait_healthy
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.traffic import Traffic

MODES = ("mp", "uni")
LIGHT_EVERY_S = 0.25
PROMPT = "The quick brown fox jumps over the lazy dog"


def cpu_seconds(service: Service) -> float:
    """User + system CPU time of the replica's process and all its children (API server, engine core, worker)."""
    total = 0.0
    try:
        root = psutil.Process(service.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def cores_used(service: Service, seconds: float) -> float:
    """The replica's CPU seconds per wall second over the next `seconds`."""
    before, started = cpu_seconds(service), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(service) - before) / (time.monotonic() - started)


def in_threads(client_loop: Callable[[int], None], clients: int) -> float:
    """Run `client_loop(index)` in `clients` threads until all return; the seconds that took."""
    started = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def saturated(url: str, model: str, seconds: float, clients: int = 8, tokens: int = 32) -> dict[str, float]:
    done = [0] * clients  # one counter per client thread: no shared read-modify-write
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                body = {"model": model, "prompt": f"{index} {done[index]} {PROMPT}", "max_tokens": tokens,
                        "ignore_eos": True, "temperature": 1.0}
                client.post("/v1/completions", json=body).raise_for_status()
                done[index] += 1

    elapsed, total = in_threads(client_loop, clients), sum(done)
    return {"completions_per_s": round(total / elapsed, 2), "tokens_per_s": round(total * tokens / elapsed, 1)}


def streaming(url: str, model: str, seconds: float, clients: int = 8, prompt_tokens: int = 48,
              tokens: int = 64) -> dict[str, float]:
    """Streamed rollouts (finished) and tokens (SSE chunks received) per second, `clients` in flight."""
    done, chunks = [0] * clients, [0] * clients  # one counter per client thread
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                body = {"model": model, "prompt": [rng.randrange(3, 900) for _ in range(prompt_tokens)],
                        "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
                        "seed": rng.randrange(2**31)}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks[index] += 1
                done[index] += 1

    elapsed = in_threads(client_loop, clients)
    return {"rollouts_per_s": round(sum(done) / elapsed, 2), "tokens_per_s": round(sum(chunks) / elapsed, 1)}


def boot(service: Service, timeout_s: float) -> float | None:
    """Seconds from start to /health 200; None when it was not healthy within `timeout_s` (a starved boot)."""
    started = time.monotonic()
    try:
        wait_healthy([service.start()], timeout_s=timeout_s)
    except TimeoutError:
        return None
    return round(time.monotonic() - started, 1)


def run_mode(mode: str, env: dict[str, str], logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    executor, extra = args.configs[mode]
    env = {**env, **extra, "VLLM_CPU_EXECUTOR": executor}
    first = replica_service(f"{mode}-first", env, logs)
    # Its own adapter root, so its own device claims: both replicas bind core 0, as two replicas sharing a core do.
    second = replica_service(f"{mode}-neighbour", {**env, "ADAPTER_ROOT": env["ADAPTER_ROOT"] + "-neighbour"}, logs)
    try:
        result: dict[str, Any] = {"boot_s": boot(first, args.timeout)}
        if result["boot_s"] is None:
            raise TimeoutError(f"{first.name} not healthy within {args.timeout:.0f} s:\n{first.log_tail()}")
        model = env["BASE_MODEL"]
        httpx.post(first.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4},
                   timeout=120).raise_for_status()  # the first request compiles; measure after it
        time.sleep(2)  # past the busy-poll window of that request
        result["idle_cores"] = round(cores_used(first, args.window), 3)
        with Traffic(first.url, model, PROMPT, every_s=LIGHT_EVERY_S, timeout_s=120) as traffic:
            time.sleep(1)
            result["light_traffic_cores"] = round(cores_used(first, args.window), 3)
            if traffic.failures:
                raise RuntimeError(f"light traffic failed: {traffic.failures[:3]}")
            result["light_traffic_p50_ms"] = round(1000 * statistics.median(traffic.latencies), 1)
            result["neighbour_boot_s"] = boot(second, args.neighbour_timeout)
        second.stop()
        result["saturated"] = saturated(first.url, model, args.window)
        result["streaming"] = streaming(first.url, model, args.window)
        return result
    finally:
        second.stop()
        first.stop()


def parse_variant(text: str) -> tuple[str, tuple[str, dict[str, str]]]:
    """"uni-unbound=uni:OMP_NUM_THREADS=2,OMP_PROC_BIND=false" -> ("uni-unbound", ("uni", {...}))."""
    name, _, spec = text.partition("=")
    executor, _, variables = spec.partition(":")
    if not name or executor not in MODES:
        raise SystemExit(f"--variant {text!r}: expected NAME=EXECUTOR[:VAR=VALUE,...], EXECUTOR one of {MODES}")
    return name, (executor, dict(item.split("=", 1) for item in variables.split(",") if item))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-replica.json"))
    parser.add_argument("--window", type=float, default=10.0, help="seconds per CPU / throughput window")
    parser.add_argument("--rounds", type=int, default=1, help="mp, uni alternated this many times")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the first replica may take to boot")
    parser.add_argument("--neighbour-timeout", type=float, default=180.0,
                        help="seconds the neighbour may take; longer is recorded as null (starved)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=EXECUTOR[:VAR=VALUE,...]",
                        help="another configuration measured beside mp and uni (repeatable)")
    args = parser.parse_args()
    args.configs = {mode: (mode, {}) for mode in MODES} | dict(parse_variant(text) for text in args.variant)
    work = Path(tempfile.mkdtemp(prefix="bench-replica-"))
    model = make_tiny_model(work / "model" / "tiny")
    (work / "adapters").mkdir()
    (work / "adapters-neighbour").mkdir()
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(work / "adapters"), "MAX_MODEL_LEN": "512",
           "VLLM_CPU_SETS": "0", "LOG_LEVEL": "WARNING"}
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.configs}
    for round_index in range(args.rounds):
        for mode in args.configs:
            print(f"round {round_index + 1}/{args.rounds}: {mode} ...", flush=True)
            rounds[mode].append(run_mode(mode, env, work / "logs", args))
            print(f"  {mode}: {json.dumps(rounds[mode][-1])}", flush=True)
    result = {RECORD_KEY: run_record(), "core_set": "0 (both replicas)",
              "light_traffic_every_s": LIGHT_EVERY_S, "window_s": args.window,
              "configs": {mode: {"executor": executor, "env": extra}
                          for mode, (executor, extra) in args.configs.items()},
              "modes": rounds}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
