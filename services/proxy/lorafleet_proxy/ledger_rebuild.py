"""An unreadable ledger file is rebuilt from what the answering replicas hold, instead of unloading the fleet.

The ledger stays `rebuilding` (no broadcast, no sync) from the moment its file is found unusable until a health
round where replicas answer: the adapters they agree on (each a content-store folder that still hashes to its name),
and the pause state they share, become the ledger.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from lorafleet.ledger_format import FINGERPRINT_PREFIX, Entry, LedgerState
from lorafleet.runs import run_of

from .ledger import Ledger, LedgerWriteError
from .metrics import Metrics
from .replica_state import Failure, Replica

log = logging.getLogger("lorafleet.proxy.fleet")

NoteFailure = Callable[[Replica, str, Failure], None]  # (replica, error, kind): HealthChecks.note_failure


async def rebuild_ledger(ledger: Ledger, metrics: Metrics, answering: list[Replica], note_failure: NoteFailure) -> None:
    """Rebuild the ledger from what the `answering` replicas hold; one that answers oddly is counted a failure."""
    views: list[tuple[dict[str, str], bool]] = []
    for replica in answering:
        try:
            views.append((await replica.client.loaded_adapters(), await replica.client.is_paused()))
        except Exception as exc:  # one replica's odd answer must not block the rebuild
            note_failure(replica, f"ledger rebuild: {type(exc).__name__}: {exc}", "malformed")
    if not views:
        return
    state = LedgerState(paused="keep" if all(paused for _, paused in views) else None)
    for name, path in agreed([listed for listed, _ in views]).items():
        why = await asyncio.to_thread(ledger.content.verify, path)
        if why:  # the replicas' lists are no evidence of content: only a store folder that hashes to its name is
            log.error("ledger rebuild: leaving out %s (%s): %s", name, path, why)
            continue
        state.adapters[name] = Entry(path, FINGERPRINT_PREFIX + Path(path).name, run_of(name)[0])
    try:
        ledger.commit(state)
    except LedgerWriteError as exc:
        log.error("ledger: rebuilt but not written (%s); retrying at the next health round", exc)
        return
    metrics.ledger_rebuilds.inc()
    log.error("ledger: REBUILT from %d replica(s) because the file was unusable (%s): adapters=%s paused=%s",
              len(views), ledger.unreadable_reason, list(state.adapters), state.paused)


def agreed(views: list[dict[str, str]]) -> dict[str, str]:
    """Adapters (name -> path) some replica holds and no replica binds to another path, in first-seen order.

    A name bound to two paths has no fleet-wide meaning and is left out (the replicas holding it drop it
    during their sync); everything else is kept, so a rebuild never unloads what no client unloaded.
    """
    seen: dict[str, set[str]] = {}
    for listed in views:
        for name, path in listed.items():
            seen.setdefault(name, set()).add(path)
    return {name: next(iter(paths)) for name, paths in seen.items() if len(paths) == 1}
