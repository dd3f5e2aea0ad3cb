"""A stand-in for TRL's rollout queue: one place for what every wrapper of it passes through unchanged."""

from __future__ import annotations

from typing import Any


class QueueView:
    """Wraps TRL's queue (`_queue`); every attribute a subclass does not define is the queue's own."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def __getattr__(self, name: str) -> Any:
        if name == "_queue":  # not built (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._queue, name)
