"""The chaos checker: judges a finished chaos run from the artifacts it left, never from what the harness believed.

It reads a chaos folder (the layout below), written while the runs trained under a nemesis, and checks the
invariants of issue 56 (`INVARIANTS`). The resume contract is judged with the trainer's own definition
(lorafleet_trainer.prompt_log, which the kill-and-resume integration test uses too). A violation names the
invariant, the run and the first record that breaks it; `render` prints it with the seed and the fault schedule
that replay it (`make chaos SEED=n`).

The chaos folder:

    chaos.json      {"seed": n, "schedule": [fault, ...],
                     "runs": {"<run>": {"max_steps": n, "max_staleness": n, "exit_code": n, "log": "<file>",
                                        "rows": n | null, "exits": [n, ...]}}}
    adapters/       the ADAPTER_ROOT: runs/<run>/{prompts.jsonl, metrics.jsonl, checkpoint-N, .vllm_lora}
    observed.jsonl  the fleet as observed during the run (observe.py), in time order: the ledger each time it
                    changed, {"time": t, "ledger": {"<name>": "<fingerprint>"}}, and once a second a fleet sample,
                    the last one after the last fault healed: {"time": t, "ledger": {...},
                             "replicas": {"<url>": ["<adapter>", ...] | null (not ready)},
                             "held": {"<url>": ["<adapter>", ...] | null (not answering)},
                             "listed_at": {"<url>": t}, "pids": {"<url>": pid | null}}

A run's `log` is its trainer's output over all its starts, relative to the folder; `exit_code` its last start's,
`exits` every start's. A replica's <url> is the one the proxy knows it by (what provenance names).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.adapters import LORA_DIR_NAME, METRICS_FILE, policy_version
from lorafleet.ratio_outliers import RATIO_FAIL
from lorafleet.runs import run_of
from lorafleet_trainer.prompt_log import (
    Breach,
    Record,
    effective,
    read_prompt_log,
    rollback_breach,
    stream_breach,
    version_breach,
)

from lorafleet_testing.chaos.client_errors import error_findings
from lorafleet_testing.chaos.fleet_history import FleetHistory, ProvenanceTally, is_sample, provenance_findings
from lorafleet_testing.chaos.resumes import resume_findings

MANIFEST = "chaos.json"
ADAPTERS = "adapters"
OBSERVED = "observed.jsonl"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
FINISHED = re.compile(r"event=finished steps=(\d+)")
ROLLBACK_BOUND = re.compile(r"event=prompt_stream .*rollback_groups_max=(\d+)")
TAIL_LINES = 120  # a stack dump of every thread (trial.py) and the lines before it

INVARIANTS = (
    "finished",  # every run reached MAX_STEPS, and its last start exited 0
    "no_step_past_max",  # no line, checkpoint or finish past MAX_STEPS (MAX_STEPS is the total across starts)
    "resume_contract",  # the final weights' steps consumed each group once, none skipped; repeats within the bound
    "versions_go_up",  # adapter versions only go up, in prompts.jsonl and in the order the fleet first loaded them
    "one_content_per_name",  # no adapter name was ever loaded with two contents
    "ledger_equals_replicas",  # at the end every ready replica holds exactly the ledger's adapters
    "importance_ratio",  # every logged ratio within 1 ± RATIO_FAIL (the doctor's FAIL line)
    "version_window",  # a run's .vllm_lora holds at most MAX_STALENESS + 2 published versions
    "provenance",  # every rollout names a content the ledger held under its name, on a replica seen holding it
    "errors_retried",  # no trainer met an error the docs do not promise to retry
)
FLEET_HISTORY = ("provenance",)  # judged only where the fleet was observed


@dataclass(frozen=True)
class RunSpec:
    """What a run was asked to do, and how its last start ended (from chaos.json)."""

    max_steps: int
    max_staleness: int
    exit_code: int | None
    log: str  # the trainer's output over all its starts
    rows: int | None = None  # the task's dataset rows, when known: prompt ids are checked against positions
    exits: tuple[int, ...] = ()  # every start's exit code, when known


@dataclass(frozen=True)
class Violation:
    invariant: str
    run: str  # "" for the fleet's invariants
    reason: str
    record: Any


@dataclass
class Report:
    seed: int | None
    schedule: list[Any]
    checked: list[str] = field(default_factory=lambda: list(INVARIANTS))
    violations: list[Violation] = field(default_factory=list)
    provenance: ProvenanceTally = field(default_factory=ProvenanceTally)
    replay: str = ""  # the command that replays the form (the manifest's; older folders have none)
    tails: dict[str, list[str]] = field(default_factory=dict)  # per run with a violation: the end of its log

    @property
    def ok(self) -> bool:
        return not self.violations

    def first(self, invariant: str) -> Violation | None:
        return next((violation for violation in self.violations if violation.invariant == invariant), None)


def check_folder(folder: Path) -> Report:
    """Every invariant over a chaos folder."""
    manifest = json.loads((folder / MANIFEST).read_text())
    runs = {name: RunSpec(max_steps=spec["max_steps"], max_staleness=spec["max_staleness"],
                          exit_code=spec.get("exit_code"), rows=spec.get("rows"), exits=tuple(spec.get("exits", ())),
                          log=(folder / spec["log"]).read_text() if (folder / spec["log"]).exists() else "")
            for name, spec in manifest["runs"].items()}
    observed_path = folder / OBSERVED
    observed = ([json.loads(line) for line in observed_path.read_text().splitlines() if line.strip()]
                if observed_path.exists() else [])
    report = check(folder / ADAPTERS, runs, observed, manifest.get("seed"), manifest.get("schedule", []))
    report.replay = manifest.get("replay", "")
    report.tails = {run: log_tail(spec.log) for run, spec in runs.items()
                    if any(violation.run == run for violation in report.violations)}
    return report


def log_tail(log: str, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines of a trainer's log, a line repeated at once kept once (retries repeat theirs): with
    the stacks a run short of its steps wrote at the deadline (trial.py), where it waited."""
    kept: list[str] = []
    for line in log.splitlines():
        if not kept or line != kept[-1]:
            kept.append(line)
    return kept[-lines:]


def check(adapter_root: Path, runs: dict[str, RunSpec], observed: list[dict[str, Any]], seed: int | None = None,
          schedule: Sequence[Any] = ()) -> Report:
    report = Report(seed, list(schedule))
    history = FleetHistory(observed) if observed else None
    if history is None:
        report.checked = [invariant for invariant in INVARIANTS if invariant not in FLEET_HISTORY]
    for run, spec in runs.items():
        report.violations += check_run(run, spec, adapter_root / "runs" / run)
        if history is not None:
            report.violations += [Violation("provenance", run, *finding) for finding in
                                  provenance_findings(adapter_root / "runs" / run, history, report.provenance)]
    report.violations += check_fleet(observed)
    return report


def check_run(run: str, spec: RunSpec, folder: Path) -> list[Violation]:
    """The invariants one run's folder and log answer for."""
    records = read_prompt_log(folder)
    found: list[Violation] = []

    def breach(invariant: str, value: Breach | None) -> None:
        if value is not None:
            found.append(Violation(invariant, run, value.reason, value.record))

    for invariant, judge in _RUN_JUDGES:
        found += [Violation(invariant, run, reason, record) for reason, record in judge(spec, folder, records)]
    final = effective(records)
    breach("resume_contract", stream_breach(final, spec.rows))
    bounds = [int(bound) for bound in ROLLBACK_BOUND.findall(spec.log)]
    if bounds:
        breach("resume_contract", rollback_breach(records, min(bounds)))
    else:
        found.append(Violation("resume_contract", run, "no start logged its rollback bound (event=prompt_stream)",
                               None))
    found += [Violation("resume_contract", run, *finding) for finding in resume_findings(spec.log, records)]
    breach("versions_go_up", version_breach(records))
    found += [Violation("errors_retried", run, *finding) for finding in error_findings(spec.log, spec.exits)]
    return found


Finding = tuple[str, Any]


def _finished(spec: RunSpec, folder: Path, records: list[Record]) -> Iterator[Finding]:
    final = effective(records)
    if spec.exit_code != 0:
        yield f"the last start exited {spec.exit_code}", spec.log.splitlines()[-1:] or None
    finishes = FINISHED.findall(spec.log)
    if not finishes or int(finishes[-1]) != spec.max_steps:
        yield f"the last start did not log event=finished steps={spec.max_steps}", finishes[-1:] or None
    if not final or final[-1]["step"] != spec.max_steps:
        yield f"the final weights went through {len(final)} steps, not {spec.max_steps}", final[-1] if final else None


def _past_max(spec: RunSpec, folder: Path, records: list[Record]) -> Iterator[Finding]:
    beyond = spec.max_steps
    yield from ((f"a prompts.jsonl line of step {r['step']}", r) for r in records if r["step"] > beyond)
    metrics = folder / METRICS_FILE
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    yield from ((f"a metrics.jsonl line of step {m['step']}", m) for m in lines if m.get("step", 0) > beyond)
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        if (match := CHECKPOINT.match(entry.name)) and int(match.group(1)) > beyond:
            yield f"{entry.name} written", str(entry)
    yield from ((f"a start finished at step {steps}", f"event=finished steps={steps}")
                for steps in FINISHED.findall(spec.log) if int(steps) > beyond)


def _ratio(spec: RunSpec, folder: Path, records: list[Record]) -> Iterator[Finding]:
    metrics = folder / METRICS_FILE
    for line in metrics.read_text().splitlines() if metrics.exists() else ():
        ratio = json.loads(line).get("ratio") if line.strip() else None
        if isinstance(ratio, int | float) and abs(ratio - 1) > RATIO_FAIL:
            yield f"importance ratio {ratio} beyond 1 ± {RATIO_FAIL}", json.loads(line)


def _window(spec: RunSpec, folder: Path, records: list[Record]) -> Iterator[Finding]:
    lora = folder / LORA_DIR_NAME
    versions = sorted(v for entry in lora.iterdir() if (v := policy_version(entry.name))) if lora.is_dir() else []
    if len(versions) > spec.max_staleness + 2:
        yield (f"{len(versions)} published versions left, more than MAX_STALENESS + 2 = {spec.max_staleness + 2}",
               versions)


_RUN_JUDGES: tuple[tuple[str, Callable[[RunSpec, Path, list[Record]], Iterator[Finding]]], ...] = (
    ("finished", _finished), ("no_step_past_max", _past_max), ("importance_ratio", _ratio),
    ("version_window", _window),
)


def check_fleet(observed: list[dict[str, Any]]) -> list[Violation]:
    """The fleet's invariants over the samples: contents per name, the order names appear in, the end state."""
    found: list[Violation] = []
    contents: dict[str, str] = {}
    loaded: set[str] = set()
    newest: dict[str, int] = {}  # per run, the highest version loaded so far
    for sample in observed:
        for name, fingerprint in sample["ledger"].items():
            if fingerprint and contents.setdefault(name, fingerprint) != fingerprint:
                found.append(Violation("one_content_per_name", "", f"{name} loaded with two contents", sample))
                contents[name] = fingerprint
            run, local = run_of(name)
            if name in loaded or (version := policy_version(local)) is None:
                continue
            loaded.add(name)
            if version < newest.get(run, 0):
                found.append(Violation("versions_go_up", run, f"{name} first loaded after v{newest[run]}", sample))
            newest[run] = max(version, newest.get(run, 0))
    samples = [line for line in observed if is_sample(line)]
    if samples:
        last = samples[-1]
        ledger = set(last["ledger"])
        for url, names in last["replicas"].items():
            if names is not None and set(names) != ledger:
                found.append(Violation("ledger_equals_replicas", "", f"{url} holds {sorted(set(names) ^ ledger)} "
                                       "unlike the ledger (symmetric difference)", last))
    return found


def render(report: Report) -> str:
    """The verdict; a violation prints the seed, the schedule and each invariant's first bad record."""
    tally = report.provenance
    undecided = (f"provenance: {tally.unverified} of {tally.answers} answers undecided by the listings"
                 + (f" (e.g. {tally.example})" if tally.unverified else ""))
    if report.ok:
        return (f"chaos seed={report.seed}: {len(report.checked)} invariants hold ({', '.join(report.checked)})\n"
                + undecided)
    replay = report.replay or f"make chaos SEED={report.seed}"
    lines = [f"chaos seed={report.seed}: {len(report.violations)} violations; replay: {replay}", undecided, "schedule:"]
    lines += [f"  {json.dumps(fault)}" for fault in report.schedule]
    for invariant in report.checked:
        if (violation := report.first(invariant)) is not None:
            lines.append(f"VIOLATION {invariant} run={violation.run or '-'}: {violation.reason}")
            lines.append(f"  first bad record: {json.dumps(violation.record, default=str)}")
    for run, tail in report.tails.items():
        lines.append(f"the end of run {run}'s trainer log ({len(tail)} lines):")
        lines += [f"  {line}" for line in tail]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a chaos folder's invariants (exit 1 on a violation).")
    parser.add_argument("folder", type=Path)
    report = check_folder(parser.parse_args(argv).folder)
    print(render(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
