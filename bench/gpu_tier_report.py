"""The GPU process tier's run as a result the docs can read: its JUnit XML and log (`make test-gpu-processes` writes
both under results/gpu/) condensed into bench/results/gpu-tier.json, with the run record of the machine it ran on.

Recorded: every test with its outcome, duration and failure message; the tier's own header lines (vLLM, the GPUs,
the placement); and the figures the tests print (the canary's bf16 distances, the tiny task's reward). The log
itself is copied beside it, so a page can link to the whole of it.

    python bench/gpu_tier_report.py [--xml results/gpu/gpu-processes.xml] [--out bench/results/gpu-tier.json]
"""

from __future__ import annotations

import argparse
import shutil
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result

HEADER = "lorafleet GPU tier"
# What the tier's tests print for the record.
# What the module prints (with -rA), by how each line starts: the canary's distances per dtype, its noise and
# tolerance over the syncs, the tiny task's reward.
PRINTED = ("bfloat16 canary distances", "float32 canary distances", "canary noise over", "tiny task reward on")


def outcomes(xml: Path) -> list[dict[str, Any]]:
    """Each test case: its name (class and test), outcome, seconds and, where it did not pass, the first line why."""
    cases = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                why = (found.get("message") or "").splitlines()[0][:300] if found.get("message") else ""
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        cases.append({"test": name, "outcome": outcome, "seconds": round(float(case.get("time") or 0), 1),
                      "why": why})
    return cases


def report(xml: Path, log: Path) -> dict[str, Any]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    cases = outcomes(xml) if xml.exists() else []
    count = {state: sum(case["outcome"] == state for case in cases) for state in ("passed", "failed", "error",
                                                                                      "skipped")}
    return {RECORD_KEY: run_record(), "tests": cases, **count, "seconds": round(sum(c["seconds"] for c in cases), 1),
            "header": [line for line in lines if line.startswith(HEADER)],
            "printed": [line.strip() for line in lines if line.strip().startswith(PRINTED)],
            "complete": xml.exists()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xml", type=Path, default=Path("results/gpu/gpu-processes.xml"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu-tier.json"))
    args = parser.parse_args()
    log = args.xml.with_suffix(".log")
    result = report(args.xml, log)
    write_result(args.out, result)
    if log.exists():
        shutil.copyfile(log, args.out.with_suffix(".log"))
    print(f"{result['passed']} passed, {result['failed']} failed, {result['error']} errors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
