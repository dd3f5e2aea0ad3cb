"""One log format for every lorafleet service: a timestamp, level, service and event, then key=value fields.

`docker compose logs` interleaves services; logfmt lines stay readable at 3 a.m. and greppable
(`grep 'event=load_failed'`). Pass fields with `extra={"fields": {...}}` or use `log_event`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(ch in text for ch in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [stamp, record.levelname, f"service={self.service}", f"logger={record.name}"]
        parts.append(f"event={_value(record.getMessage())}")
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            parts += [f"{key}={_value(val)}" for key, val in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(service: str, level: str = "INFO", *, loggers: tuple[str, ...] = ()) -> None:
    """Send lorafleet's logs (and those of `loggers`, e.g. "trl") to stderr in logfmt."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter(service))
    for name in ("lorafleet", f"lorafleet_{service}", *loggers):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event` with structured `fields`."""
    logger.log(level, event, extra={"fields": fields})
