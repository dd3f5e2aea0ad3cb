"""The agreement canary's verdicts (canary.py): majority, reference, tolerance, and the cases without a majority."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import StackSettings
from lorafleet_proxy.canary import Canary, CanaryAnswer, MalformedProbe, parse_answer
from lorafleet_proxy.metrics import Metrics

KEY = ("trl-policy-v3", "sha256:abc")
GOOD = CanaryAnswer((7, 8, 9), (-0.5, -0.25, -0.125))
OTHER_WEIGHTS = CanaryAnswer((7, 8, 9), (-0.9, -0.25, -0.125))  # same tokens, a logprob far beyond the tolerance
OTHER_TOKENS = CanaryAnswer((7, 8, 10), (-0.5, -0.25, -0.125))


def canary(tolerance: float = 0.02) -> Canary:
    return Canary(StackSettings(_env_file=None, proxy_canary_logprob_tolerance=tolerance), Metrics())


def test_a_strict_majority_decides_and_becomes_the_reference() -> None:
    judge = canary()
    verdict = judge.judge(KEY, {"a": GOOD, "b": GOOD, "c": OTHER_WEIGHTS})
    assert verdict.decided and verdict.odd == ["c"]
    assert "c departs from the majority's answer" in verdict.why and "0.4" in verdict.why
    assert judge.references[KEY] == GOOD


def test_other_tokens_depart_whatever_the_logprobs() -> None:
    assert canary(tolerance=10.0).judge(KEY, {"a": GOOD, "b": GOOD, "c": OTHER_TOKENS}).odd == ["c"]


def test_batch_noise_within_the_tolerance_is_agreement() -> None:
    noisy = CanaryAnswer(GOOD.tokens, tuple(value + 0.019 for value in GOOD.logprobs))
    assert canary().judge(KEY, {"a": GOOD, "b": noisy}).odd == []
    assert canary(tolerance=0.01).judge(KEY, {"a": GOOD, "b": noisy, "c": GOOD}).odd == ["b"]


def test_answers_that_part_at_a_near_tie_agree_and_a_clear_lead_that_flips_departs() -> None:
    tied = CanaryAnswer((7, 8, 9), (-0.70, -0.25, -0.125), (0.5, 0.01, 0.5))  # 8 led its runner-up by 0.01
    flipped = CanaryAnswer((7, 11, 12), (-0.70, -0.26, -3.0), (0.5, 0.02, 0.9))  # noise chose the runner-up
    assert tied.agrees(flipped, 0.02) and flipped.agrees(tied, 0.02)
    assert not tied.agrees(flipped, 0.004)  # a lead of 0.01 is beyond twice that tolerance: not a tie
    clear = CanaryAnswer((7, 8, 9), (-0.70, -0.25, -0.125), (0.5, 3.0, 0.5))
    assert not clear.agrees(flipped, 0.02)  # one side led by 3 nats: other weights, not noise
    before = CanaryAnswer((7, 8, 9), (-0.9, -0.25, -0.125), (0.5, 0.01, 0.5))
    assert not before.agrees(flipped, 0.02)  # the tokens before the tie already departed by 0.2


def test_two_that_disagree_are_undecided_without_a_reference_and_judged_by_it_with_one() -> None:
    judge = canary()
    verdict = judge.judge(KEY, {"a": GOOD, "b": OTHER_WEIGHTS})
    assert not verdict.decided and verdict.odd == [] and "no reference" in verdict.why
    assert KEY not in judge.references
    judge.judge(KEY, {"a": GOOD, "b": GOOD})  # they agreed once: that answer is the reference
    verdict = judge.judge(KEY, {"a": GOOD, "b": OTHER_WEIGHTS})
    assert verdict.decided and verdict.odd == ["b"] and "the reference" in verdict.why


def test_one_replica_is_compared_with_what_it_answered_first() -> None:
    judge = canary()
    assert judge.judge(KEY, {"a": GOOD}).odd == []  # the first answer is the reference
    assert judge.judge(KEY, {"a": OTHER_WEIGHTS}).odd == ["a"]
    assert judge.judge(KEY, {"a": GOOD}).odd == []


def test_no_answer_is_no_vote_and_forget_drops_the_subjects_references() -> None:
    judge = canary()
    assert judge.judge(KEY, {}).decided and judge.judge(KEY, {}).odd == []
    judge.judge(KEY, {"a": GOOD})
    judge.forget("trl-policy-v3")
    assert judge.references == {}


@given(st.integers(min_value=3, max_value=9), st.data())
def test_any_minority_departing_from_a_majority_is_exactly_the_odd_set(replicas: int, data: Any) -> None:
    bad = data.draw(st.sets(st.integers(min_value=0, max_value=replicas - 1), max_size=(replicas - 1) // 2))
    wrong = data.draw(st.sampled_from([OTHER_WEIGHTS, OTHER_TOKENS]))
    answers = {f"r{i}": wrong if i in bad else GOOD for i in range(replicas)}
    verdict = canary().judge(KEY, answers)
    assert verdict.decided and sorted(verdict.odd) == sorted(f"r{i}" for i in bad)


def test_a_probe_answer_is_read_from_vllms_completion_body() -> None:
    body = {"choices": [{"text": " a b", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.5, -0.5]}}]}
    assert parse_answer(body) == CanaryAnswer((5, 6), (-1.5, -0.5))
    body["choices"][0]["logprobs"]["top_logprobs"] = [{" a": -1.5, " b": -1.75}, {" b": -0.5}]
    assert parse_answer(body).margins == (0.25, float("inf"))  # a lone entry says nothing about a runner-up
    assert parse_answer({"choices": [{"text": " a", "logprobs": {"token_logprobs": [-1]}}]}).tokens == (" a",)
    with pytest.raises(MalformedProbe, match="without tokens and logprobs"):
        parse_answer({"choices": [{"text": " a"}]})
