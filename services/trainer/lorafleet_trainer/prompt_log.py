"""prompts.jsonl read back: the steps the final weights went through, and the resume contract judged on them.

The trainer writes one line per optimizer step (resume.PromptTracker): `step`, `attempt` (the start that wrote it),
`policy_version`, `positions` (the prompt-stream positions the step consumed, stale drops included), `prompts` (their
dataset rows), `dropped` and `next` (the stream's first unconsumed position). A kill leaves the lines of the steps
past the resumed checkpoint behind; the next start writes those steps again. The integration test of kill-and-resume
and the chaos checker both judge a run with the functions here, so the contract has one definition. Light on
purpose (no transformers): the checker imports it outside any trainer.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

PROMPTS_FILE = "prompts.jsonl"  # in the run folder: one line per optimizer step, the prompt groups it consumed

Record = dict[str, Any]


@dataclass(frozen=True)
class Breach:
    """Where a prompt log breaks the contract: why, and the first line that shows it."""

    reason: str
    record: Record


def read_prompt_log(run_folder: Path) -> list[Record]:
    """Every line of the run's prompts.jsonl, in write order (none when the run never trained)."""
    path = run_folder / PROMPTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def effective(records: list[Record]) -> list[Record]:
    """The steps the final weights went through: a start resuming at step S supersedes earlier lines of steps > S."""
    kept: list[Record] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def rolled_back(records: list[Record]) -> list[Record]:
    """The lines a kill rolled back: written, then superseded by a later start's line of the same step."""
    kept = {id(record) for record in effective(records)}
    return [record for record in records if id(record) not in kept]


def stream_breach(final: list[Record], rows: int | None = None) -> Breach | None:
    """The final weights' steps against the contract: steps 1, 2, ... in order, each group consumed once, none below
    the stream's head skipped, and (given the dataset's `rows`) each line's prompt ids its positions' rows."""
    seen: set[int] = set()
    for index, record in enumerate(final):
        if record["step"] != index + 1:
            return Breach(f"step {index + 1} missing from the final weights' steps", record)
        twice = [position for position in record["positions"] if position in seen]
        if twice:
            return Breach(f"groups consumed twice into the final weights: {twice}", record)
        seen.update(record["positions"])
        if rows and record["prompts"] != [position % rows for position in record["positions"]]:
            return Breach(f"prompt ids are not the positions' rows (rows={rows})", record)
        skipped = sorted(set(range(record["next"])) - seen)
        if skipped:
            return Breach(f"groups skipped: {skipped}", record)
    return None


def trained(record: Record) -> list[int]:
    """The line's groups that trained samples: its positions less its stale drops (which took none)."""
    dropped = set(record["dropped"])
    return [position for position in record["positions"] if position not in dropped]


def rollback_breach(records: list[Record], bound: int) -> Breach | None:
    """Each start's rolled-back lines repeat at most `bound` trained groups (resume.rollback_bound, logged at every
    start). Stale drops come on top: a resume generates them again, it never trains them twice."""
    lines = rolled_back(records)
    per_start = Counter(record["attempt"] for record in lines for _ in trained(record))
    for attempt, repeated in per_start.items():
        if repeated > bound:
            first = next(record for record in lines if record["attempt"] == attempt)
            return Breach(f"a kill rolled back {repeated} groups, past the logged bound {bound}", first)
    return None


def version_breach(records: list[Record]) -> Breach | None:
    """Adapter versions only go up, across starts: a start publishes past every name an earlier one published."""
    for before, record in pairwise(records):
        if record["policy_version"] <= before["policy_version"]:
            return Breach(f"policy version {record['policy_version']} after {before['policy_version']}", record)
    return None
