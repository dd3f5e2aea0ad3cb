"""The agreement canary: every replica that serves a name must decode it with the same weights.

A probe is one small fixed greedy completion (`CANARY_PROMPT`, PROXY_CANARY_TOKENS tokens, temperature 0, the chosen
tokens' log-probabilities and the runner-up's). `Canary.judge` compares the answers of the replicas serving one
subject (the same tokens, log-probabilities within PROXY_CANARY_LOGPROB_TOLERANCE, a near-tie no evidence) and
decides by strict majority, else by the subject's reference (kept per subject and content fingerprint, in memory).
What the fleet does with an odd replica is canary_watch.py's and broadcast.py's. Why, and the verdicts in full:
docs/concepts/provenance.md.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMClient, VLLMError

from .metrics import Metrics

log = logging.getLogger("lorafleet.proxy.canary")

CANARY_PROMPT = "lorafleet canary: the same weights decode the same words"
BASE_SUBJECT = ""  # the base model, as a subject (adapters are subjects by their fleet-unique names)
Key = tuple[str, str]  # (subject, what it is: an adapter's fingerprint or path, the base model's name)


@dataclass(frozen=True, slots=True)
class CanaryAnswer:
    """What a probe returned: the greedy tokens (ids, or the text where a replica gives none), their logprobs, and
    per token how far the runner-up was behind (empty where the replica did not say: no position is a near-tie)."""

    tokens: tuple[Any, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...] = ()

    def agrees(self, other: CanaryAnswer, tolerance: float) -> bool:
        if len(self.tokens) != len(other.tokens) or len(self.logprobs) != len(other.logprobs):
            return False
        for position, (mine, theirs) in enumerate(zip(self.tokens, other.tokens, strict=True)):
            if mine != theirs:  # parted: the same weights only at a near-tie, and what follows is not comparable
                return self.tied(position, tolerance) and other.tied(position, tolerance)
            if position < len(self.logprobs) and abs(self.logprobs[position] - other.logprobs[position]) > tolerance:
                return False
        return True

    def tied(self, position: int, tolerance: float) -> bool:
        """Whether batch noise within `tolerance` could have chosen the runner-up at `position`."""
        return position < len(self.margins) and self.margins[position] <= 2 * tolerance

    def distance(self, other: CanaryAnswer) -> float:
        """The largest logprob difference (inf when the tokens differ): what a log line shows."""
        if self.tokens != other.tokens or len(self.logprobs) != len(other.logprobs):
            return float("inf")
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)


class MalformedProbe(ValueError):
    """A probe's answer without the fields a verdict needs."""


def parse_answer(body: dict[str, Any]) -> CanaryAnswer:
    try:
        choice = body["choices"][0]
        tokens = choice.get("token_ids") or [choice["text"]]
        logprobs = choice["logprobs"]["token_logprobs"]
        margins = tuple(_margin(top) for top in choice["logprobs"].get("top_logprobs") or ())
        return CanaryAnswer(tuple(tokens), tuple(float(value) for value in logprobs), margins)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise MalformedProbe(f"probe answer without tokens and logprobs: {type(exc).__name__}: {exc}") from exc


def _margin(top: dict[str, float] | None) -> float:
    """The lead of the top token over the runner-up (inf without a runner-up: two ids that decode to one string
    share a key, so nothing is known)."""
    values = sorted((float(value) for value in (top or {}).values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


@dataclass
class Verdict:
    """The judgement of one round of answers: who departs, and whether anything could be decided."""

    odd: list[str] = field(default_factory=list)  # replica URLs whose answer departs
    decided: bool = True
    why: str = ""


class Canary:
    """Probes and judges; remembers each subject's agreed answer (its reference)."""

    def __init__(self, settings: ProxySettings, metrics: Metrics) -> None:
        self.tolerance = settings.proxy_canary_logprob_tolerance
        self.tokens = settings.proxy_canary_tokens
        self.timeout_s = settings.proxy_canary_timeout_s
        self.metrics = metrics
        self.references: dict[Key, CanaryAnswer] = {}
        self.rounds = 0
        self.last_round: float | None = None  # monotonic time of the last periodic round

    def request(self, model: str) -> dict[str, Any]:
        return {"model": model, "prompt": CANARY_PROMPT, "max_tokens": self.tokens, "temperature": 0.0,
                "logprobs": 2, "return_token_ids": True, "ignore_eos": True}

    async def probe(self, client: VLLMClient, model: str) -> CanaryAnswer | None:
        """One probe; None when the replica gave no usable answer (the breaker and the health loop see to it)."""
        self.metrics.canary_probes.inc()
        try:
            return parse_answer(await client.completions(self.request(model), timeout=self.timeout_s))
        except (VLLMError, MalformedProbe) as exc:
            self.metrics.canary_probe_failures.inc()
            log.warning("canary probe failed replica=%s model=%s: %s", client.base_url, model, exc)
            return None

    async def probe_all(self, model: str, clients: dict[str, VLLMClient]) -> dict[str, CanaryAnswer]:
        """Every replica (URL -> client) at once; those that gave no usable answer are left out."""
        results = await asyncio.gather(*(self.probe(client, model) for client in clients.values()))
        return {url: answer for url, answer in zip(clients, results, strict=True) if answer is not None}

    def judge(self, key: Key, answers: dict[str, CanaryAnswer]) -> Verdict:
        """Who departs from the others (module docstring); records the reference when a majority agrees."""
        if not answers:
            return Verdict(why="no replica answered the probe: no vote")  # the breaker and health loop see to it
        reference = self.references.get(key)
        groups: list[list[str]] = []
        for url, answer in answers.items():
            for group in groups:
                if answers[group[0]].agrees(answer, self.tolerance):
                    group.append(url)
                    break
            else:
                groups.append([url])
        largest = max(groups, key=len)
        if len(answers) > 1 and len(largest) * 2 > len(answers):
            self.references[key] = answers[largest[0]]
            odd = [url for url in answers if url not in largest]
            return Verdict(odd, why=self._why(odd, answers, answers[largest[0]], "the majority"))
        if reference is not None:
            odd = [url for url, answer in answers.items() if not answer.agrees(reference, self.tolerance)]
            return Verdict(odd, why=self._why(odd, answers, reference, "the reference"))
        if len(answers) == 1:
            self.references[key] = next(iter(answers.values()))
            return Verdict()
        self.metrics.canary_undecided.inc()
        return Verdict(decided=False, why=f"{len(answers)} replicas answer differently and no reference can tell "
                       "which is right")

    def agrees_with_reference(self, key: Key, answer: CanaryAnswer) -> bool | None:
        """A lone replica's answer against the subject's reference (None: no reference yet)."""
        reference = self.references.get(key)
        return None if reference is None else answer.agrees(reference, self.tolerance)

    def forget(self, subject: str) -> None:
        """The subject left the fleet (an adapter unloaded or rebound): its references go."""
        for key in [key for key in self.references if key[0] == subject]:
            del self.references[key]

    @staticmethod
    def _why(odd: list[str], answers: dict[str, CanaryAnswer], agreed: CanaryAnswer, whose: str) -> str:
        return "; ".join(f"{url} departs from {whose}'s answer (tokens {list(answers[url].tokens)} vs "
                         f"{list(agreed.tokens)}, largest logprob difference {answers[url].distance(agreed):.4g})"
                         for url in odd)
