"""The broadcast epoch: whether a reading of the replicas taken without the fleet lock still holds.

The health, canary and attestation rounds read replicas without the lock (a broadcast must not wait on them); a
broadcast that ran, or runs, meanwhile may have changed what they read, so they act on it only when
`unchanged_since` the epoch they noted before reading. `Fleet.broadcasting` moves the epoch at both ends.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Broadcasts(Protocol):
    """The fleet's lock and broadcast epoch (fleet.Fleet is one)."""

    lock: asyncio.Lock
    broadcast_epoch: int


def unchanged_since(fleet: Broadcasts, epoch: int) -> bool:
    """No broadcast runs now and none ran since the fleet's epoch was `epoch`."""
    return not fleet.lock.locked() and epoch == fleet.broadcast_epoch
