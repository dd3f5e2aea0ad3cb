"""A trainer's ratio report (POST /ratio_report) acted on: its importance ratio says one replica decodes an adapter
with other weights than its peers, which the fleet treats as a canary disagreement.

The replica leaves routing and re-syncs ("quarantined") while another ready replica serves the adapter; the last
ready holder is only re-checked by the canary, which alone may take it out ("rechecked"). Why:
docs/concepts/provenance.md.
"""

from __future__ import annotations

import logging
from typing import Protocol

from .replica_state import Replica, State

log = logging.getLogger("lorafleet.proxy.fleet")


class RatioFleet(Protocol):
    """What a ratio report needs of the fleet (fleet.Fleet is one): the ready replicas, to quarantine one, and the
    canary's re-check of the last holders."""

    def ready(self) -> list[Replica]: ...

    def quarantine(self, replica: Replica, subject: str, reason: str) -> None: ...

    async def recheck(self, subject: str, replicas: list[Replica], why: str) -> None: ...


async def act_on_report(fleet: RatioFleet, replica: Replica, subject: str, evidence: str) -> str:
    """The outcome for `replica` doubted on `subject`: quarantined, rechecked, not_loaded, or the state it is in
    when it is out of routing already (its catch-up ends with the canary's probe)."""
    reason = f"importance ratio: {evidence}"
    log.error("ratio report url=%s subject=%s: %s", replica.url, subject, evidence)
    if replica.state is not State.READY:
        return replica.state.value
    if subject not in replica.adapters:
        return "not_loaded"  # unloaded since: nothing of it to doubt
    if any(other is not replica and subject in other.adapters for other in fleet.ready()):
        fleet.quarantine(replica, subject, reason)
        return "quarantined"
    await fleet.recheck(subject, [replica], reason)
    return "quarantined" if replica.state is not State.READY else "rechecked"
