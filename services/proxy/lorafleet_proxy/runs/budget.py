"""The LoRA slot budget of a shared fleet: what every run reserves, what the replicas can hold, who is refused.

Every replica's `--max-loras` is shared: a run reserves `lorafleet.runs.run_slots(max_staleness)` slots (declared
with POST /runs/<run>/register, or the proxy's MAX_STALENESS when it never registered), and is admitted only while
the reservations of all runs fit the smallest `--max-loras` of the ready replicas. A run that does not fit is
REFUSED (409 naming the budget and who holds it), not queued: a run holds its slots for hours, so a queued trainer
would sit in TRL's timeouts with no message, while a refusal changes nothing and says what to do. A run never
holds more adapters than it reserved (409 again), so no replica holds more registered adapters than its slots and
vLLM's LRU never has to evict an adapter in use. Slots are counted as vLLM frees them: an unloaded adapter keeps
its slot until a later load lets LRU reclaim it (vllm#54839); `SlotBook` shows those as `unreclaimed`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from lorafleet.ledger_format import LedgerState, RunRecord
from lorafleet.runs import BUDGET_ERROR, DEFAULT_RUN
from lorafleet.settings import ProxySettings

from ..errors import error
from ..metrics import Metrics

log = logging.getLogger("lorafleet.proxy.runs")


class SlotBook:
    """LoRA slots as vLLM frees them, fleet-wide (every ready replica holds the ledger): adapters registered,
    plus unloaded ones still resident until a later load lets LRU reclaim one (vllm#54839)."""

    def __init__(self) -> None:
        self.registered: set[str] = set()
        self.unreclaimed: list[str] = []  # oldest first

    def observe(self, names: set[str], capacity: int | None) -> None:
        gone = [name for name in self.registered if name not in names]
        loads = len(names - self.registered)
        self.unreclaimed += sorted(gone)
        self.unreclaimed = [name for name in self.unreclaimed if name not in names]  # a reload takes its slot again
        if capacity is not None:
            for _ in range(loads):  # each load beyond the capacity makes LRU reclaim one slot
                if len(names) + len(self.unreclaimed) > capacity and self.unreclaimed:
                    self.unreclaimed.pop(0)
        self.registered = set(names)


class SlotBudget:
    """The slot arithmetic, once: capacity, reservations, what a run may hold, admission and its refusal."""

    def __init__(self, settings: ProxySettings, capacities: Callable[[], list[int]], metrics: Metrics) -> None:
        self.settings = settings
        self.capacities = capacities  # the --max-loras of every ready replica
        self.metrics = metrics
        self.book = SlotBook()

    def capacity(self) -> int | None:
        """The smallest --max-loras of the ready replicas: the slots every run's adapters must share."""
        slots = self.capacities()
        return min(slots) if slots else None

    def observe(self, state: LedgerState) -> None:
        self.book.observe(set(state.adapters), self.capacity())

    def reservations(self, state: LedgerState) -> dict[str, int]:
        """Slots each run holds: registered runs, and runs that own ledger entries (the proxy's MAX_STALENESS
        when they never registered)."""
        owners = {entry.run for entry in state.adapters.values()}
        return {run: state.runs[run].slots if run in state.runs else self.settings.run_slots
                for run in [*state.runs, *sorted(owners - set(state.runs))]}

    def slots_for(self, run: str, state: LedgerState) -> int:
        """The slots `run` holds, or could get now if it registered (what its /server_info reports as --max-loras)."""
        reserved = self.reservations(state)
        if run in reserved:
            return reserved[run]
        capacity = self.capacity()
        return 0 if capacity is None else max(capacity - sum(reserved.values()), 0)

    def view(self, state: LedgerState) -> dict[str, Any]:
        reserved = self.reservations(state)
        capacity = self.capacity()
        return {"capacity": capacity, "reserved": sum(reserved.values()), "by_run": reserved,
                "free": None if capacity is None else capacity - sum(reserved.values()),
                "registered_adapters": len(self.book.registered), "unreclaimed": list(self.book.unreclaimed)}

    def admit(self, state: LedgerState, run: str, record: RunRecord | None = None) -> JSONResponse | None:
        """Admit `run` if its reservation fits beside the others' (registering `record` in `state`, to be committed);
        the 409 when it does not.

        `record` None (a load or pause): a run that holds slots already stays; any other named run is registered
        with the proxy's MAX_STALENESS; the default run is admitted without a registration (it reserves slots by
        holding adapters) and, alone with no named run, without a check: the single-run fleet as before.
        """
        reserved = self.reservations(state)
        if record is None:
            if run in reserved or run in state.runs:
                return None
            if run == DEFAULT_RUN and not reserved:
                return None
            slots = self.settings.run_slots
        else:
            current = state.runs.get(run)
            record = RunRecord(record.max_staleness, record.weight, current.paused if current else None)
            slots = record.slots
        capacity = self.capacity()
        others = sum(held for other, held in reserved.items() if other != run)
        if capacity is not None and others + slots > capacity:
            return self.refusal(run, slots, state, "does not fit the fleet's slot budget")
        if record is not None or run != DEFAULT_RUN:
            state.runs[run] = record or RunRecord(self.settings.max_staleness)
        return None

    def check_load(self, state: LedgerState, run: str, qualified: str) -> JSONResponse | None:
        """A run may hold at most the slots it reserved (the default run only once named runs share the fleet)."""
        if run == DEFAULT_RUN and not any(other != DEFAULT_RUN for other in self.reservations(state)):
            return None
        slots = self.reservations(state).get(run, self.settings.run_slots)
        held = [name for name, entry in state.adapters.items() if entry.run == run and name != qualified]
        if len(held) + 1 > slots:
            return self.refusal(run, len(held) + 1, state, f"would hold more adapters than the {slots} slot(s) "
                                f"it reserved (it holds {len(held)})")
        return None

    def refusal(self, run: str, needed: int, state: LedgerState, why: str) -> JSONResponse:
        reserved = self.reservations(state)
        reserved.pop(run, None)
        capacity = self.capacity()
        holders = ", ".join(f"{other} ({slots})" for other, slots in reserved.items()) or "no other run"
        message = (f"run {run!r} {why}: it needs {needed} LoRA slot(s) (max_staleness + 2) and the fleet's slot "
                   f"budget is {capacity} (the replicas' --max-loras), of which {holders} hold "
                   f"{sum(reserved.values())}. Wait for a run to finish or expire (RUN_LEASE_S="
                   f"{self.settings.run_lease_s:.0f}), lower MAX_STALENESS, or raise FLEET_MAX_RUNS.")
        self.metrics.run_refusals.inc()
        log.warning("run refused run=%s needed=%d capacity=%s held=%s", run, needed, capacity, reserved)
        return error(409, message, BUDGET_ERROR)
