"""The demo's live progress line: the step and the wall budget left, the latest held-out pass@1 and when the next
evaluation comes, the training values, the replicas and routing; printed only when something changed.

What counts as a change is the training, the evaluation and the replicas (a step logged, an evaluation logged, a
replica's state or adapters); the clock and the routing counters move on their own and do not trigger a line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lorafleet_ops.commands.status import adapter_span, fmt, latest

EVAL_PASS = "eval/pass_at_1"
EVAL_STEP = "eval/step"


@dataclass(frozen=True)
class Progress:
    """One moment of one run, split into what a line is printed for and what it only shows."""

    step: str
    evaluation: str
    training: str
    replicas: str
    routing: str  # shown, never a reason to print

    @property
    def key(self) -> tuple[str, ...]:
        return self.step, self.evaluation, self.training, self.replicas


def evaluation_status(metrics: list[dict[str, Any]], every: int) -> str:
    """The latest held-out pass@1 (the step it scored) and the next pass: passes start after step 1 and every
    `every` steps (lorafleet_trainer.evaluation), and are logged when they finish."""
    if every <= 0:
        return "no held-out eval"
    evals = [row for row in metrics if EVAL_PASS in row and EVAL_STEP in row]
    scored = int(evals[-1][EVAL_STEP]) if evals else 0
    due = 1 if scored < 1 else (scored // every + 1) * every
    step = latest(metrics, "step") or 0
    coming = f"eval of step {due} running" if step >= due else f"next eval at step {due}"
    if not evals:
        return f"held-out pass@1 - ({coming})"
    return f"held-out pass@1 {float(evals[-1][EVAL_PASS]):.2f} at step {scored} ({coming})"


def read_progress(steps: int | None, metrics: list[dict[str, Any]], fleet: dict[str, Any], eval_every: int) -> Progress:
    """The run's progress from its metrics.jsonl and the proxy's /fleet."""
    replicas = fleet.get("replicas", [])
    ready = sum(1 for r in replicas if r.get("state") == "ready")
    router = fleet.get("router", {})
    routed = int(router.get("routed", 0))
    hit = f"{100 * router.get('affinity', 0) / routed:.0f}%" if routed else "-"
    adapters = "; ".join(f"{r.get('state')}: {adapter_span(list(r.get('adapters', {})))}" for r in replicas)

    def last(key: str, spec: str) -> str:
        return fmt(latest(metrics, key), spec)

    return Progress(
        step=f"step {last('step', 'd')}" + (f"/{steps}" if steps else ""),
        evaluation=evaluation_status(metrics, eval_every),
        training=(f"reward {last('reward', '.3f')}  ratio {last('ratio', '.4f')}  "
                  f"queue {last('sample/rollout_queue_size', '.0f')}  staleness {last('sample/staleness_mean', '.2f')}"
                  f"  sync {last('perf/weight_sync_s', '.2f')}s"),
        replicas=f"replicas {ready}/{len(replicas)} [{adapters}]",
        routing=f"routing affinity {hit} of {routed}",
    )


def wall_budget(defaults: dict[str, Any]) -> float | None:
    """The trainer's RUN_MAX_WALL_S as it resolves it: the environment's, else the task's default; None: no budget."""
    return float(os.environ.get("RUN_MAX_WALL_S") or defaults.get("run_max_wall_s") or 0) or None


def minutes(seconds: float) -> str:
    """`12m05s`: a duration as a person reads it."""
    whole = max(0, round(seconds))
    return f"{whole // 60}m{whole % 60:02d}s"


def render(progress: Progress, elapsed_s: float, wall_left_s: float | None) -> str:
    """One line; `wall_left_s` is the trainer's wall budget (RUN_MAX_WALL_S) left, None when it has none."""
    if wall_left_s is None:
        budget = ""
    elif wall_left_s > 0:
        budget = f", {minutes(wall_left_s)} of the wall budget left"
    else:  # the trainer's own clock started a little later than ours: it ends its step, saves and exits
        budget = ", wall budget spent: finishing"
    return (f"[{elapsed_s:5.0f}s] {progress.step}{budget} | {progress.evaluation} | {progress.training} | "
            f"{progress.replicas} | {progress.routing}")


class ChangedOnly:
    """Says, per run, whether its progress changed since the line last printed for it."""

    def __init__(self) -> None:
        self._printed: dict[str, tuple[str, ...]] = {}

    def due(self, run: str, progress: Progress) -> bool:
        if self._printed.get(run) == progress.key:
            return False
        self._printed[run] = progress.key
        return True
