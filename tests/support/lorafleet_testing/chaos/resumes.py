"""Each start's resume point against the prompt log: a resume one group early or late is caught where it starts.

A start logs where its prompt stream resumes (`event=prompt_stream resume_at=<head> skip=<n>`), after `event=resuming
... step=<S>` when it resumes checkpoint-S (none: a fresh start, S = 0). checkpoint-S holds the groups the steps up to
S consumed, as prompts.jsonl showed them when that start began: the lines of earlier starts (a start's `attempt` is
its clock when it set up its prompt stream, after its `event=resuming` line: earlier starts' are before that line),
superseded as `effective` does, up to step S. A log of the last starts only (a container's) is judged the same way.
The resume must start at that set's head and skip exactly the consumed groups above it. Early, a group is consumed
twice (stream_breach sees that too); late, the group jumped over is never consumed and the trainer's own head stays
there, which no line-by-line check of prompts.jsonl can tell from a slow group.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterator
from typing import Any

from lorafleet_trainer.prompt_log import Record, effective

Finding = tuple[str, Any]

RESUMING = re.compile(r"event=resuming .*?\bstep=(\d+)")
STREAM = re.compile(r"event=prompt_stream resume_at=(\d+) skip=(\d+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z")


def _stamp(line: str) -> float | None:
    """The log line's time (the trainer's UTC stamp), None when it has none."""
    match = STAMP.match(line)
    if match is None:
        return None
    return calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")) + float(match.group(2) or 0)


def head_and_above(records: list[Record], step: int) -> tuple[int, int]:
    """The consumed set of the steps up to `step` of `records` (effective): its head and how many groups lie above."""
    consumed = {p for record in effective(records) if record["step"] <= step for p in record["positions"]}
    head = next(p for p in range(len(consumed) + 1) if p not in consumed)
    return head, sum(1 for p in consumed if p > head)


def resume_findings(log: str, records: list[Record]) -> Iterator[Finding]:
    """Each start whose logged resume point is not its checkpoint's head and skip set."""
    step, began = 0, float("-inf")  # the step this start resumes, and when it said so
    for line in log.splitlines():
        if match := RESUMING.search(line):
            step, began = int(match.group(1)), _stamp(line) or float("-inf")
        elif match := STREAM.search(line):
            earlier = [record for record in records if record["attempt"] < began]
            head, above = head_and_above(earlier, step)
            logged = int(match.group(1)), int(match.group(2))
            if logged != (head, above):
                yield (f"a start resuming step {step} set its stream at {logged[0]} skipping {logged[1]}; the prompt "
                       f"log's checkpoint-{step} holds head {head} and {above} above it"), line
            step, began = 0, float("-inf")
