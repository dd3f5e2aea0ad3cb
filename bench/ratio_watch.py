"""The ratio watch's sequential test calibrated on real runs: how much evidence healthy replicas gather against each
other, and how many tokens each faulty replica took to be named; writes bench/results/bench-ratio-watch.json.

Reads the trainer's own `ratio_by_replica` rows from metrics.jsonl files (no replica is started here) and replays
`lorafleet.ratio_outliers.RatioWatch` over them, window by window, as the trainer does:
- `--healthy LABEL=PATH`: a run whose replicas all served the right weights. Per ordered pair of replicas on one
  version in one window (a `Step`): the standardized excess divergence and the log-likelihood ratio it adds, their
  spread and largest values, the largest CUSUM score any pair reached, and any naming (a false alarm). The
  false-alarm rate is estimated by replaying the run's own steps, drawn at random with replacement, for
  `--replay-windows` windows per pair (a bootstrap: the order of windows is all it changes), and stated per
  replica-hour at the run's own pace of windows with a step per pair, times its peers.
- `--faulty LABEL=PATH` with `--fault URL=WHAT` for each faulty replica of it: the tokens each took to be named
  (its first naming), its excess divergence then, and `tokens_to_name` at that excess: the bound the docs state.

    .venv/bin/pytest tests/integration/test_ratio_watch.py tests/integration/test_trainer.py --basetemp=results/rw
    .venv/bin/python bench/ratio_watch.py --healthy trainer=results/rw/.../metrics.jsonl \\
        --faulty acceptance=results/rw/.../metrics.jsonl --fault http://127.0.0.1:PORT="base model" ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from lorafleet import ratio_outliers
from lorafleet.ratio_outliers import METRICS_KEY, RatioWatch, ReplicaRatio, read_rows, steps, tokens_to_name
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result

HOUR_S = 3600.0


def windows_of(path: Path, replicas: set[str] | None = None) -> list[tuple[float, list[ReplicaRatio]]]:
    """(time, rows) of each logged window of a metrics.jsonl, in order; only `replicas`' rows where given."""
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and METRICS_KEY in record:
            rows = [row for row in read_rows(record[METRICS_KEY]) if replicas is None or row.replica in replicas]
            found.append((float(record.get("time", 0.0)), rows))
    return found


def replay(threshold: float, llrs: list[float], windows: int, rng: random.Random) -> int:
    """Alarms of one pair's CUSUM over `windows` of steps drawn from `llrs` (named: start over)."""
    score, alarms = 0.0, 0
    for _ in range(windows):
        score = max(0.0, score + rng.choice(llrs))
        if score > threshold:
            alarms, score = alarms + 1, 0.0
    return alarms


def healthy(label: str, source: str, replay_windows: int, rng: random.Random) -> dict[str, Any]:
    """A healthy run's figures; `source` is PATH, or PATH@URL,URL,... for those replicas of a run only."""
    path, _, only = source.partition("@")
    windows = windows_of(Path(path), set(only.split(",")) if only else None)
    watch, named, top = RatioWatch(), [], 0.0
    all_steps = []
    for _, rows in windows:
        named += [found.evidence() for found in watch.judge(rows)]
        top = max([top, *(held.score for held in watch.evidence.values())])
        all_steps += steps(rows)
    replicas = sorted({row.replica for _, rows in windows for row in rows})
    hours = (windows[-1][0] - windows[0][0]) / HOUR_S if len(windows) > 1 else 0.0
    pairs = sorted({(step.row.replica, step.peer.replica) for step in all_steps})
    llrs = [step.llr for step in all_steps]
    standardized = [step.standardized for step in all_steps]
    result: dict[str, Any] = {
        "label": label, "windows": len(windows), "hours": round(hours, 4), "replicas": len(replicas),
        "steps": len(all_steps), "pairs": len(pairs), "tokens": sum(row.tokens for _, rows in windows for row in rows),
        "named": named, "largest_score": round(top, 3),
        "excess_nats": _spread([step.excess for step in all_steps]), "standardized": _spread(standardized),
        "llr": _spread(llrs),
    }
    if llrs and hours > 0:
        steps_per_pair_hour = len(all_steps) / len(pairs) / hours
        alarms = sum(replay(ratio_outliers.EVIDENCE_THRESHOLD, llrs, replay_windows, rng) for _ in pairs)
        per_pair_step = alarms / (replay_windows * len(pairs))
        result["replayed_steps"] = replay_windows * len(pairs)
        result["replayed_alarms"] = alarms
        # A replica is named against any of its peers: its rate is its pairs' (len(replicas) - 1) rates summed.
        result["false_alarms_per_replica_hour"] = per_pair_step * steps_per_pair_hour * (len(replicas) - 1)
        result["false_alarms_per_replica_hour_at_most"] = (
            max(per_pair_step, 1 / (replay_windows * len(pairs))) * steps_per_pair_hour * (len(replicas) - 1))
    return result


def faulty(label: str, path: Path, faults: dict[str, str]) -> dict[str, Any]:
    watch, first = RatioWatch(), {}
    windows = windows_of(path)
    for step, (_, rows) in enumerate(windows, start=1):
        for found in watch.judge(rows):
            first.setdefault(found.replica, (step, found))
    named = {}
    for url, what in faults.items():
        if url not in first:
            named[what] = {"replica": url, "named": False}
            continue
        step, found = first[url]
        named[what] = {"replica": url, "named": True, "step": step, "tokens": found.tokens,
                       "excess_nats": round(found.departure, 4), "spread_nats": round(found.spread, 4),
                       "bound_tokens": tokens_to_name(found.departure, found.spread), "evidence": found.evidence()}
    healthy_named = sorted(url for url in first if url not in faults)
    return {"label": label, "windows": len(windows), "faults": named, "healthy_named": healthy_named}


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"n": len(values), "mean": round(statistics.fmean(values), 4),
            "sd": round(statistics.pstdev(values), 4), "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 4),
            "max": round(ordered[-1], 4)}


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=VALUE, got {item!r}")
        pairs.append((key, value))
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy", action="append", default=[],
                        help="LABEL=metrics.jsonl of a healthy run (LABEL=metrics.jsonl@URL,URL: those replicas)")
    parser.add_argument("--faulty", action="append", default=[], help="LABEL=metrics.jsonl of a run with faults")
    parser.add_argument("--fault", action="append", default=[], help="URL=WHAT: a faulty replica and its fault")
    parser.add_argument("--replay-windows", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=66)
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-ratio-watch.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    faults = dict(_pairs(args.fault))
    result = {
        RECORD_KEY: run_record(),
        "settings": {"divergence_shift_nats": ratio_outliers.DIVERGENCE_SHIFT_NATS,
                     "token_sd_floor_nats": ratio_outliers.TOKEN_SD_FLOOR_NATS,
                     "evidence_threshold": ratio_outliers.EVIDENCE_THRESHOLD,
                     "min_tokens": ratio_outliers.MIN_TOKENS},
        "healthy": [healthy(label, source, args.replay_windows, rng) for label, source in _pairs(args.healthy)],
        "faulty": [faulty(label, Path(path), faults) for label, path in _pairs(args.faulty)],
    }
    write_result(args.out, result, shown={key: value for key, value in result.items() if key != RECORD_KEY})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
