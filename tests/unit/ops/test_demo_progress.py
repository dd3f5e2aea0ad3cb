"""The demo's live progress line: what it shows (step, wall budget left, the latest held-out pass@1 and the next
pass, training, replicas, routing) and that it prints only when the run or the fleet changed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_ops.commands.progress import (
    ChangedOnly,
    evaluation_status,
    minutes,
    read_progress,
    render,
    wall_budget,
)

pytestmark = pytest.mark.timeout(60)

FLEET = {
    "replicas": [
        {"url": "http://127.0.0.1:9001", "state": "ready", "adapters": {f"trl-policy-v{v}": "/a" for v in (6, 7)}},
        {"url": "http://127.0.0.1:9002", "state": "ejected", "adapters": {}},
    ],
    "router": {"routed": 160, "affinity": 136},
}


def steps(count: int, evals: dict[int, float] | None = None) -> list[dict]:
    """metrics.jsonl rows of `count` steps; an eval pass that started at step s is logged with step s + 1."""
    rows: list[dict] = []
    for step in range(1, count + 1):
        if step - 1 in (evals or {}):
            rows.append({"step": step, "eval/step": step - 1, "eval/pass_at_1": evals[step - 1]})
        rows.append({"step": step, "reward": 0.1 * step, "ratio": 1.0})
    return rows


def test_the_line_shows_step_budget_eval_training_replicas_and_routing():
    progress = read_progress(None, steps(12, {1: 0.16, 5: 0.39, 10: 0.42}), FLEET, eval_every=5)
    line = render(progress, 312.4, 648.0)
    assert line.startswith("[  312s] step 12, 10m48s of the wall budget left | ")
    assert "held-out pass@1 0.42 at step 10 (next eval at step 15)" in line and "step 12/-" not in line
    assert "reward 1.200" in line and "replicas 1/2" in line and "routing affinity 85% of 160" in line
    assert render(read_progress(60, steps(3), FLEET, 5), 9.0, None).startswith("[    9s] step 3/60 | ")
    assert render(progress, 960.0, -2.0).startswith("[  960s] step 12, wall budget spent: finishing | ")


@pytest.mark.parametrize(("rows", "every", "said"), [
    (steps(0), 5, "held-out pass@1 - (next eval at step 1)"),
    (steps(1), 5, "held-out pass@1 - (eval of step 1 running)"),
    (steps(4, {1: 0.25}), 5, "held-out pass@1 0.25 at step 1 (next eval at step 5)"),
    (steps(7, {1: 0.25}), 5, "held-out pass@1 0.25 at step 1 (eval of step 5 running)"),
    (steps(7, {1: 0.25, 5: 0.5}), 5, "held-out pass@1 0.50 at step 5 (next eval at step 10)"),
    (steps(7), 0, "no held-out eval"),
])
def test_the_evaluation_part_says_the_latest_pass_and_the_next(rows, every, said):
    assert evaluation_status(rows, every) == said


def test_the_wall_budget_is_the_environment_s_else_the_task_s(monkeypatch):
    monkeypatch.delenv("RUN_MAX_WALL_S", raising=False)
    assert wall_budget({"run_max_wall_s": 900}) == 900.0 and wall_budget({}) is None
    monkeypatch.setenv("RUN_MAX_WALL_S", "120")
    assert wall_budget({"run_max_wall_s": 900}) == 120.0
    assert minutes(648.4) == "10m48s" and minutes(-3) == "0m00s"


def test_a_line_prints_when_training_eval_or_replicas_change_never_for_the_clock_or_routing():
    changed = ChangedOnly()
    first = read_progress(None, steps(4, {1: 0.2}), FLEET, 5)
    assert changed.due("demo", first) and not changed.due("demo", first)
    busier = {**FLEET, "router": {"routed": 400, "affinity": 300}}
    assert not changed.due("demo", read_progress(None, steps(4, {1: 0.2}), busier, 5))  # routing alone: no line
    assert changed.due("other", first)  # each run its own
    assert changed.due("demo", read_progress(None, steps(5, {1: 0.2}), FLEET, 5))  # a step
    assert changed.due("demo", read_progress(None, steps(5, {1: 0.2, 4: 0.3}), FLEET, 5))  # an eval logged
    moved = {**FLEET, "replicas": [{**FLEET["replicas"][0], "state": "draining"}, FLEET["replicas"][1]]}
    assert changed.due("demo", read_progress(None, steps(5, {1: 0.2, 4: 0.3}), moved, 5))  # a replica


@settings(max_examples=100, deadline=None)
@given(views=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 500)), min_size=1, max_size=30))
def test_lines_print_exactly_at_the_changes(views):
    """Any sequence of polls (steps logged, replicas ready, routed count): a line exactly when the step or the
    replicas differ from the last printed poll."""
    changed, printed = ChangedOnly(), None
    for count, ready, routed in views:
        fleet = {"replicas": [{"state": "ready" if i < ready else "loading", "adapters": {}} for i in range(2)],
                 "router": {"routed": routed, "affinity": 0}}
        progress = read_progress(None, steps(count), fleet, 5)
        assert changed.due("demo", progress) is (printed != (count, ready))
        printed = (count, ready)
