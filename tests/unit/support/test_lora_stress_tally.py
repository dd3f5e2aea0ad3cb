"""The stress test's judge (lorafleet_testing/reload_stress.py): an answer within the tolerance of its subject's
reference matches; one farther is a mismatch named by the subject whose reference it sits nearest."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from lorafleet_testing.reload_stress import POSITIONS, TOLERANCE, Tally, probe_body

LOGPROB = st.floats(-20.0, 0.0)
REFERENCE = st.lists(LOGPROB, min_size=POSITIONS, max_size=POSITIONS)


@given(REFERENCE, st.lists(st.floats(-TOLERANCE / 2, TOLERANCE / 2), min_size=POSITIONS, max_size=POSITIONS))
def test_an_answer_within_the_tolerance_matches(reference: list[float], noise: list[float]) -> None:
    tally = Tally()
    tally.record("base", [value + delta for value, delta in zip(reference, noise, strict=True)], {"base": reference})
    summary = tally.summary()
    assert (summary["answers_checked"], summary["mismatches"]) == (1, 0)
    assert summary["largest_gap"] == summary["largest_gap_matching"] <= TOLERANCE


@given(REFERENCE, st.floats(0.01, 2.0), st.integers(0, POSITIONS - 1))
def test_an_answer_of_other_weights_is_named_by_the_nearest_reference(
        reference: list[float], shift: float, position: int) -> None:
    adapter = [value - shift if index == position else value for index, value in enumerate(reference)]
    tally = Tally()
    tally.record("base", adapter, {"base": reference, "run1-v1": adapter})
    tally.record("run1-v1", adapter, {"base": reference, "run1-v1": adapter})
    summary = tally.summary()
    assert summary["checked"] == {"base": 1, "run1-v1": 1}
    assert summary["mismatched"] == {"base": 1}
    assert summary["decoded_as"] == {"base": {"run1-v1": 1}}
    assert summary["largest_gap_matching"] == 0.0
    assert abs(summary["largest_gap"] - shift) < 1e-9


def test_every_probe_has_its_own_cache_salt_and_the_subjects_text() -> None:
    first, second = probe_body("m", "run1-v1"), probe_body("m", "run1-v1")
    assert first["cache_salt"] != second["cache_salt"]
    assert first["prompt"] == second["prompt"] and len(first["prompt"]) == POSITIONS
    assert all(prompt.startswith("run1-v1 ") for prompt in first["prompt"])
    assert (first["max_tokens"], first["temperature"], first["logprobs"]) == (1, 0.0, 0)
