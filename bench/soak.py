"""Churn soak of the fleet controller: many completions while replicas die and adapters come and go.

Processes, as deployed: three fake vLLM replicas (lorafleet_testing.fakes in tests/support, each its own process so
that a kill is a real SIGKILL), the real `lorafleet-proxy` console script, and this load generator.
While `--concurrency` clients send completions (base model and the live adapter versions), one task
publishes a new adapter version every `--publish-every-s` (pause keep, load, resume, then unload the
version that left the window, as TRL's adapter-only sync does) and another kills a replica every
`--kill-every-s` and restarts it on the same port after `--down-s`.

Writes JSON to --out: requests sent, client-visible failures (goal 0) by status, proxy RSS and open
file descriptors after warm-up and at the end, and the time from each replica restart to ready.

    .venv/bin/python bench/soak.py --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.adapters import adapter_dir
from lorafleet.ports import free_port
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import rss_mib, script
from lorafleet_testing.fakes import FakeReplica, start_server, weights_file

ROOT = Path(__file__).resolve().parents[1]

MODEL = "fake-base"
WINDOW = 3  # adapter versions kept loaded (max_staleness-like)


async def serve_fake(port: int, latency_ms: float) -> None:
    fake = FakeReplica()
    fake.faults.latency_s = latency_ms / 1000
    server = await start_server(fake.app(), port)
    fake.url = server.url
    await asyncio.Event().wait()


class Replicas:
    """Fake replicas as child processes on fixed ports: killed with SIGKILL, restarted on the same port."""

    def __init__(self, count: int, latency_ms: float) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.latency_ms = latency_ms
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count

    def start(self, index: int) -> None:
        self.procs[index] = subprocess.Popen([sys.executable, __file__, "--serve-fake", str(self.ports[index]),
                                              "--latency-ms", str(self.latency_ms)])

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[index] = None

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def stop(self) -> None:
        for index in range(len(self.procs)):
            self.kill(index)


def proc_stats(pid: int) -> dict[str, float]:
    return {"rss_mib": rss_mib(pid), "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def publish(root: Path, version: int) -> str:
    directory = adapter_dir(root, "soak", f"trl-policy-v{version}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (directory / "adapter_model.safetensors").write_bytes(weights_file(os.urandom(256)))
    return str(directory)


async def wait_ready(http: httpx.AsyncClient, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = (await http.get("/fleet")).json()
            if sum(r["state"] == "ready" for r in view["replicas"]) == count:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the fleet did not become ready within {timeout}s")


async def soak(args: argparse.Namespace, replicas: Replicas, proxy: subprocess.Popen[bytes], proxy_url: str,
               root: Path) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60, limits=limits) as http:
        await wait_ready(http, len(replicas.ports))
        live: list[str] = []  # adapter names clients may use: loaded, not about to be unloaded
        sent = 0
        failures: collections.Counter[str] = collections.Counter()
        examples: list[str] = []
        restarts: list[float] = []
        broadcasts: collections.Counter[str] = collections.Counter()
        stop = asyncio.Event()
        naming: collections.Counter[str] = collections.Counter()  # requests in flight per model

        async def client(seed: int) -> None:
            nonlocal sent
            rng = random.Random(seed)
            while not stop.is_set() and sent < args.requests:
                model = rng.choice([MODEL, *live]) if live else MODEL
                prompt = [rng.randrange(1000) for _ in range(48)]
                sent += 1
                naming[model] += 1
                try:
                    response = await http.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                                        "max_tokens": 3})
                    status = str(response.status_code)
                    text = response.text
                except httpx.TransportError as exc:
                    status, text = type(exc).__name__, str(exc)
                finally:
                    naming[model] -= 1
                if status != "200":
                    failures[status] += 1
                    if len(examples) < 10:
                        examples.append(f"{status} {model}: {text[:300]}")

        async def publisher() -> None:
            version = 0
            while not stop.is_set():
                version += 1
                name, path = f"trl-policy-v{version}", publish(root, version)
                for op, call in (("pause", http.post("/pause", params={"mode": "keep"})),
                                 ("load", http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                                  "lora_path": path})),
                                 ("resume", http.post("/resume"))):
                    response = await call
                    broadcasts[f"{op} {response.status_code}"] += 1
                    if op == "load" and response.status_code == 200:
                        live.append(name)
                if len(live) > WINDOW:
                    old = live.pop(0)
                    while naming[old]:  # requests naming it finish first, as TRL's staleness window ensures
                        await asyncio.sleep(0.05)
                    response = await http.post("/v1/unload_lora_adapter", json={"lora_name": old})
                    broadcasts[f"unload {response.status_code}"] += 1
                await asyncio.sleep(args.publish_every_s)

        samples: list[dict[str, float]] = []

        async def sampler() -> None:  # the proxy's RSS and fds along the run: warm-up, then flat (or a leak)
            while not stop.is_set():
                router = (await http.get("/fleet")).json()["router"]  # the bounded table is what RSS may grow by
                samples.append({"requests": sent, "tracked_blocks": router["tracked_blocks"], **proc_stats(proxy.pid)})
                await asyncio.sleep(args.sample_every_s)

        async def chaos() -> None:
            rng = random.Random(args.seed)
            while not stop.is_set():
                await asyncio.sleep(args.kill_every_s)
                index = rng.randrange(len(replicas.ports))
                replicas.kill(index)
                await asyncio.sleep(args.down_s)
                replicas.start(index)
                started = time.monotonic()
                url = replicas.urls()[index]
                while not stop.is_set():
                    view = (await http.get("/fleet")).json()
                    if any(r["url"] == url and r["state"] == "ready" for r in view["replicas"]):
                        restarts.append(time.monotonic() - started)
                        break
                    await asyncio.sleep(0.05)

        await asyncio.sleep(1.0)
        before = proc_stats(proxy.pid)
        started = time.monotonic()
        background = [asyncio.create_task(publisher()), asyncio.create_task(chaos()), asyncio.create_task(sampler())]
        clients = [asyncio.create_task(client(seed)) for seed in range(args.concurrency)]
        await asyncio.wait(clients, timeout=args.max_duration_s)
        stop.set()
        await asyncio.gather(*clients, *background, return_exceptions=True)
        elapsed = time.monotonic() - started
        for index, proc in enumerate(replicas.procs):
            if proc is None:
                replicas.start(index)
        await wait_ready(http, len(replicas.ports))
        await asyncio.sleep(1.0)
        after = proc_stats(proxy.pid)
        metrics = (await http.get("/metrics")).text
        loop_errors = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith("lorafleet_proxy_loop_errors_total"))
    return {
        "requests_sent": sent,
        "client_visible_failures": sum(failures.values()),
        "failures_by_status": dict(failures),
        "failure_examples": examples,
        "duration_s": round(elapsed, 1),
        "requests_per_s": round(sent / elapsed, 1),
        "replica_restarts": len(restarts),
        "restart_to_ready_s": ({"median": round(statistics.median(restarts), 3), "max": round(max(restarts), 3)}
                               if restarts else None),
        "broadcasts": dict(broadcasts),
        "proxy_at_start": before,
        "proxy_at_end": after,
        "proxy_samples": samples,
        "rss_growth_last_half_mib": (round(samples[-1]["rss_mib"] - samples[len(samples) // 2]["rss_mib"], 1)
                                     if len(samples) >= 2 else None),
        "max_tracked_blocks": int(os.environ.get("PROXY_MAX_TRACKED_BLOCKS", "0")) or None,
        "proxy_loop_errors": loop_errors,
        "settings": {key: getattr(args, key) for key in ("requests", "concurrency", "kill_every_s", "down_s",
                                                         "publish_every_s", "latency_ms", "health_interval_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--max-duration-s", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kill-every-s", type=float, default=4.0)
    parser.add_argument("--down-s", type=float, default=1.5)
    parser.add_argument("--publish-every-s", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--health-interval-s", type=float, default=0.5)
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        asyncio.run(serve_fake(args.serve_fake, args.latency_ms))
        return
    replicas = Replicas(args.replicas, args.latency_ms)
    with tempfile.TemporaryDirectory(prefix="lorafleet-soak-") as tmp:
        root = Path(tmp)
        port = free_port()
        env = {**os.environ, "PROXY_UPSTREAMS": ",".join(replicas.urls()), "PROXY_UPSTREAM_DNS": "",
               "ADAPTER_ROOT": str(root), "PROXY_FLEET_HOST": "127.0.0.1", "PROXY_PORT": str(port), "PROXY_API_KEY": "",
               "PROXY_HEALTH_INTERVAL_S": str(args.health_interval_s), "LORAFLEET_ENV_FILE": "",
               "LOG_LEVEL": "WARNING"}
        for index in range(args.replicas):
            replicas.start(index)
        proxy = subprocess.Popen([script("lorafleet-proxy")], env=env, cwd=tmp)
        try:
            measured = asyncio.run(soak(args, replicas, proxy, f"http://127.0.0.1:{port}", root))
            report = {RECORD_KEY: run_record(), **measured}
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(10)
            replicas.stop()
    write_result(args.out, report, shown=report)
    if report["client_visible_failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
