"""Waiting, in async tests, for a condition the system under test reaches by itself (a replica re-admitted)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def until(condition: Callable[[], Awaitable[Any]], what: str, timeout: float = 5.0) -> Any:
    """Poll `condition()` every 20 ms until it returns something truthy; fail naming `what` if it never does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(0.02)
