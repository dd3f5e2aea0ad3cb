"""The checklist as a fixed-width table an operator reads (the CLI, the demo, the trainer's refusal)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from lorafleet_ops.commands.doctor.model import CheckResult, Status


def render_table(results: Sequence[CheckResult], width: int = 100) -> str:
    """Number, check, status, reason, and the fix on its own line when not PASS; counts last."""
    name_w = max(len(r.name) for r in results)
    indent = 4 + name_w + 2 + 4 + 2
    wrap = max(width - indent, 40)
    lines = [f"{'#':>2}  {'CHECK':<{name_w}}  {'STAT':<4}  DETAIL"]
    for number, result in enumerate(results):
        reason = _wrap(result.reason, wrap) or [""]
        lines.append(f"{number:>2}  {result.name:<{name_w}}  {result.status.value:<4}  {reason[0]}")
        lines += [" " * indent + more for more in reason[1:]]
        if result.fix and result.status is not Status.PASS:
            lines += [" " * indent + text for text in _wrap("fix: " + result.fix, wrap)]
    counts = {status: sum(r.status is status for r in results) for status in Status}
    lines.append(", ".join(f"{count} {status.value}" for status, count in counts.items() if count))
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    """Wrap at spaces only: paths, URLs and flags stay whole (copy-pasteable) even when longer than a line."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)
