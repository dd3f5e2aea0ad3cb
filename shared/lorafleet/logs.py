"""One log format for every lorafleet service: a timestamp, level, service and event, then key=value fields.

`docker compose logs` interleaves services; logfmt lines stay readable at 3 a.m. and greppable
(`grep 'event=load_failed'`). Pass fields with `extra={"fields": {...}}` or use `log_event`. A proxy or trainer that
seems stuck shows where without being stopped: SIGUSR1 writes every thread's stack to its log (`kill -USR1 <pid>`,
`docker compose kill -s USR1 trainer`). Not a replica: `lorafleet-replica` execs vLLM, for which SIGUSR1 is fatal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import signal
import sys
import time
from typing import Any


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(ch in text for ch in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    """`fields` go on every line after the service (e.g. `rank=1` when several trainer ranks share one log)."""

    def __init__(self, service: str, fields: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.prefix = [f"service={service}", *(f"{key}={_value(val)}" for key, val in (fields or {}).items())]

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [stamp, record.levelname, *self.prefix, f"logger={record.name}"]
        parts.append(f"event={_value(record.getMessage())}")
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            parts += [f"{key}={_value(val)}" for key, val in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(service: str, level: str = "INFO", *, loggers: tuple[str, ...] = (),
              fields: dict[str, Any] | None = None) -> None:
    """Send lorafleet's logs (and those of `loggers`, e.g. "trl") to stderr in logfmt, `fields` on every line;
    SIGUSR1 dumps every thread's stack there."""
    stacks_on_sigusr1()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter(service, fields))
    for name in ("lorafleet", f"lorafleet_{service}", *loggers):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def stacks_on_sigusr1() -> None:
    """From now on SIGUSR1 writes every thread's stack to stderr (the log) and the process goes on: what
    `configure` sets up, and what a process that logs without it (the trainer's rollout child) calls itself."""
    with contextlib.suppress(io.UnsupportedOperation, ValueError):  # a stderr with no descriptor (captured): no dumps
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event` with structured `fields`."""
    logger.log(level, event, extra={"fields": fields})
