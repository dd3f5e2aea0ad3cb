"""Several training runs on one fleet: run identity, adapter namespaces, the slot budget, run pauses, leases.

Identity. A trainer reaches the proxy under `/runs/<run>/` (TRAINER_VLLM_URL=http://proxy:8000/runs/b):
TRL joins its base URL and the route (`/v1/completions`, `/pause`, ...), so an unmodified client works
under the prefix. The front strips it and marks the request with its run. A request without it belongs
to the default run, which is exactly the single-run fleet: its names are not qualified, its pauses are
the fleet's (broadcast or elided), it never expires.

Namespaces. Run `b`'s adapter `trl-policy-v3` is `b--trl-policy-v3` on the replicas and in the ledger
(`lorafleet.ledger_file.qualify`); the proxy maps names in (load, unload, generation `model`) and back in
every answer (bodies, errors, /v1/models), so runs can hold the same TRL names at once. A run sees and
touches only its own names; on the fleet port the default run cannot name another run's adapter either.
The public port (operators, evaluation) may generate with any run's adapter by its qualified name.

Slot budget. Every replica's `--max-loras` is shared: a run reserves `max_staleness + 2` slots (declared
with POST /runs/<run>/register, or the proxy's MAX_STALENESS when it never registered), and is admitted
only while the reservations of all runs fit the smallest `--max-loras` of the ready replicas. A run that
does not fit is REFUSED (409 naming the budget and who holds it), not queued: a run holds its slots for
hours, so a queued trainer would sit in TRL's timeouts with no message, while a refusal changes nothing
and says what to do. A run never holds more adapters than it reserved (409 again), so no replica holds
more registered adapters than its slots and vLLM's LRU never has to evict an adapter in use. Slots are
counted as vLLM frees them: an unloaded adapter keeps its slot until a later load lets LRU reclaim it
(vllm#54839); `SlotBook` shows those as `unreclaimed`.

Run pauses. A named run's pause (any mode) holds that run's new generation requests at the proxy and
never pauses a replica; `wait` also answers only once the run's requests in flight are done. `abort`
cannot abort one run's requests on a shared engine (vLLM's /abort_requests is refused by the proxy), so
it holds new requests like `keep`. The pause is in the ledger and survives a proxy restart.

Leases. A named run that sends nothing for RUN_LEASE_S is expired: its adapters leave the ledger in one
durable write and are unloaded from every ready replica (one that fails re-syncs to the ledger without
them: all or nothing), its reservation is returned, the event logged and counted. A trainer that comes
back re-registers and republishes (TRL does on start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from fastapi.responses import JSONResponse, Response
from lorafleet.ledger_file import LedgerState, RunRecord
from lorafleet.runs import BUDGET_ERROR, DEFAULT_RUN, RUN_SEPARATOR, RUN_URL_PREFIX, check_run_name, run_of
from lorafleet.settings import Settings

from .broadcast import commit_state, error, ledger_failed, unload_from_ready

if TYPE_CHECKING:
    from .fleet import Fleet
    from .metrics import Metrics

log = logging.getLogger("lorafleet.proxy.runs")

RUN_SCOPE_KEY = "lorafleet.run"  # set by the front on every request: the run it belongs to
WAIT_POLL_S = 0.02


def split_run_path(path: str) -> tuple[str, str]:
    """`/runs/<run>/<rest>` -> (run, `/<rest>`); raises RunNameError for a malformed run name."""
    run, _, rest = path[len(RUN_URL_PREFIX):].partition("/")
    return check_run_name(run), "/" + rest


def rename_body(body: bytes, qualified: str, name: str) -> bytes:
    """The run's own name in place of its qualified one, wherever the replica's answer wrote it."""
    return body.replace(qualified.encode(), name.encode()) if qualified != name else body


def renamed(response: Response, qualified: str, name: str) -> Response:
    """A proxy-made answer (not streamed) with the run's names in place of the fleet-unique ones."""
    if qualified == name:
        return response
    headers = {key: value for key, value in response.headers.items() if key != "content-length"}
    return Response(rename_body(bytes(response.body), qualified, name), response.status_code, headers)


@dataclass
class LiveRun:
    """What the proxy knows of a run beyond the ledger: its lease, its requests, its pause gate, its tokens."""

    name: str
    last_seen: float = field(default_factory=time.monotonic)
    inflight: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    running: asyncio.Event = field(default_factory=asyncio.Event)  # set while the run is not paused

    def __post_init__(self) -> None:
        self.running.set()


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


class Runs:
    """The runs sharing the fleet: registrations (in the ledger), live state, budget, pauses and leases."""

    def __init__(self, settings: Settings, fleet: Fleet, metrics: Metrics) -> None:
        self.settings = settings
        self.fleet = fleet
        self.ledger = fleet.ledger
        self.metrics = metrics
        self.live: dict[str, LiveRun] = {}
        self.slots = SlotBook()
        self.foreign: frozenset[str] = frozenset()  # fleet-unique names of named runs' adapters (front's check)
        self.shared = False  # a named run is registered or holds adapters: pauses, fair share and tokens per run
        self._weights: dict[str, float] = {}
        self.ledger.observers.append(self._observe)
        self._observe(self.ledger.state())

    # --- identity and live state -----------------------------------------------------------------
    def get(self, run: str) -> LiveRun:
        live = self.live.get(run)
        if live is None:
            live = self.live[run] = LiveRun(run)
        return live

    def touch(self, run: str) -> LiveRun:
        """A request of `run` arrived: its lease starts over."""
        live = self.get(run)
        live.last_seen = time.monotonic()
        return live

    def _observe(self, state: LedgerState) -> None:
        """Follow every ledger change: pause gates, the slot book, the names the default run may not see."""
        self.foreign = frozenset(name for name, entry in state.adapters.items() if entry.run != DEFAULT_RUN)
        self.shared = bool(self.foreign) or any(run != DEFAULT_RUN for run in state.runs)
        self._weights = {run: record.weight for run, record in state.runs.items()}
        self.slots.observe(set(state.adapters), self.capacity())
        for run, record in state.runs.items():
            gate = self.get(run).running
            if record.paused is None:
                gate.set()
            else:
                gate.clear()
        for run, live in self.live.items():
            if run not in state.runs:
                live.running.set()

    def weight(self, run: str) -> float:
        return self._weights.get(run, 1.0)

    def count_tokens(self, live: LiveRun, answer: bytes) -> int | None:
        """Add a non-streamed answer's `usage` to the run's counts; the tokens it generated (None: unknown)."""
        usage = None
        with contextlib.suppress(ValueError, AttributeError):
            usage = orjson.loads(answer).get("usage") if answer else None
        if not isinstance(usage, dict):
            return None
        prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(generated, int):
            return None
        live.prompt_tokens += prompt
        live.generated_tokens += generated
        self.metrics.run_tokens.labels(live.name, "prompt").inc(prompt)
        self.metrics.run_tokens.labels(live.name, "generated").inc(generated)
        return generated

    # --- the budget ------------------------------------------------------------------------------
    def capacity(self) -> int | None:
        """The smallest --max-loras of the ready replicas: the slots every run's adapters must share."""
        slots = [r.info.lora.max_loras for r in self.fleet.ready() if r.info is not None and r.info.lora is not None]
        return min(slots) if slots else None

    def reservations(self, state: LedgerState) -> dict[str, int]:
        """Slots each run holds: registered runs, and runs that own ledger entries (the proxy's MAX_STALENESS
        when they never registered)."""
        owners = {entry.run for entry in state.adapters.values()}
        return {run: state.runs[run].slots if run in state.runs else self.settings.run_slots
                for run in [*state.runs, *sorted(owners - set(state.runs))]}

    def slots_for(self, run: str) -> int:
        """The slots `run` holds, or could get now if it registered (what its /server_info reports as --max-loras)."""
        state = self.ledger.state()
        reserved = self.reservations(state)
        if run in reserved:
            return reserved[run]
        capacity = self.capacity()
        return 0 if capacity is None else max(capacity - sum(reserved.values()), 0)

    def budget(self) -> dict[str, Any]:
        state = self.ledger.state()
        reserved = self.reservations(state)
        capacity = self.capacity()
        return {"capacity": capacity, "reserved": sum(reserved.values()), "by_run": reserved,
                "free": None if capacity is None else capacity - sum(reserved.values()),
                "registered_adapters": len(self.slots.registered), "unreclaimed": list(self.slots.unreclaimed)}

    def _refusal(self, run: str, needed: int, state: LedgerState, why: str) -> JSONResponse:
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
            return self._refusal(run, slots, state, "does not fit the fleet's slot budget")
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
            return self._refusal(run, len(held) + 1, state, f"would hold more adapters than the {slots} slot(s) "
                                 f"it reserved (it holds {len(held)})")
        return None

    async def register(self, run: str, max_staleness: int, weight: float) -> Response:
        """POST /runs/<run>/register: reserve max_staleness + 2 slots (409 when they do not fit); idempotent."""
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            refusal = self.admit(state, run, RunRecord(max_staleness, weight))
            if refusal is not None:
                return refusal
            if not state.same_as(self.ledger.state()) and (failed := self._commit(state)) is not None:
                return failed
        self.touch(run)
        log.info("run registered run=%s max_staleness=%d weight=%g slots=%d", run, max_staleness, weight,
                 max_staleness + 2)
        return JSONResponse({"run": run, "slots": max_staleness + 2, "weight": weight, "budget": self.budget()})

    def _commit(self, state: LedgerState) -> JSONResponse | None:
        exc = commit_state(self.fleet, state)
        return None if exc is None else ledger_failed(exc, "nothing changed")

    # --- run pauses ------------------------------------------------------------------------------
    async def pause(self, run: str, mode: str) -> Response:
        """Hold the run's new requests at the proxy (no replica pauses); `wait` also waits for its in-flight ones."""
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            refusal = self.admit(state, run)
            if refusal is not None:
                return refusal
            # a run holding adapters may have no registration (a ledger rebuilt from the replicas): the proxy's own
            current = state.runs.get(run) or RunRecord(self.settings.max_staleness)
            state.runs[run] = RunRecord(current.max_staleness, current.weight, mode)
            if (failed := self._commit(state)) is not None:
                return failed
        live = self.get(run)
        while mode == "wait" and live.inflight > 0 and self.ledger.runs().get(run, RunRecord(0)).paused == mode:
            await asyncio.sleep(WAIT_POLL_S)
        log.info("run paused run=%s mode=%s (held at the proxy; replicas keep generating)", run, mode)
        return JSONResponse({"status": "paused"})

    async def resume(self, run: str) -> Response:
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            record = state.runs.get(run)
            if record is not None and record.paused is not None:
                state.runs[run] = RunRecord(record.max_staleness, record.weight, None)
                if (failed := self._commit(state)) is not None:
                    return failed
        log.info("run resumed run=%s", run)
        return JSONResponse({"status": "resumed"})

    def paused(self, run: str) -> bool:
        record = self.ledger.runs().get(run)
        return record is not None and record.paused is not None

    # --- leases ----------------------------------------------------------------------------------
    async def expire_idle(self) -> None:
        """Expire every named run that sent nothing for RUN_LEASE_S and has nothing in flight."""
        now = time.monotonic()
        state = self.ledger.state()
        owners = {entry.run for entry in state.adapters.values()} | set(state.runs)
        for run in sorted(owners - {DEFAULT_RUN}):
            live = self.get(run)
            if live.inflight == 0 and now - live.last_seen >= self.settings.run_lease_s:
                await self.expire(run, f"no request for {now - live.last_seen:.0f}s (RUN_LEASE_S)")

    async def expire(self, run: str, why: str) -> bool:
        """Unload the run's adapters fleet-wide, all or nothing, and return its slots; False when the ledger could
        not be written (nothing changed, retried at the next round)."""
        async with self.fleet.broadcasting():
            if self.ledger.rebuilding:
                return False
            state = self.ledger.state()
            names = [name for name, entry in state.adapters.items() if entry.run == run]
            for name in names:
                del state.adapters[name]
            state.runs.pop(run, None)
            if self._commit(state) is not None:
                log.error("run expiry failed run=%s: the ledger could not be written; retried", run)
                return False
            for name in names:
                await unload_from_ready(self.fleet, name, f"run {run} expired")
        self.live.pop(run, None)
        for per_run in (self.metrics.run_slots, self.metrics.run_adapters, self.metrics.run_inflight,
                        self.metrics.run_share):
            with contextlib.suppress(KeyError):
                per_run.remove(run)
        self.metrics.run_expirations.inc()
        log.warning("run expired run=%s reason=%s unloaded=%s (slots returned)", run, why, names)
        return True

    @staticmethod
    def own_name(qualified: str) -> str:
        """The name the run that owns `qualified` knows it by."""
        return run_of(qualified)[1]

    def export(self) -> None:
        """Set the per-run gauges for a /metrics scrape."""
        for row in self.view():
            run = row["run"]
            self.metrics.run_slots.labels(run).set(row["slots"])
            self.metrics.run_adapters.labels(run).set(len(row["adapters"]))
            self.metrics.run_inflight.labels(run).set(row["inflight"])
            self.metrics.run_share.labels(run).set(row["share"])
        budget = self.budget()
        self.metrics.slots.labels("capacity").set(budget["capacity"] or 0)
        self.metrics.slots.labels("reserved").set(budget["reserved"])
        self.metrics.slots.labels("unreclaimed").set(len(budget["unreclaimed"]))

    # --- operators' view -------------------------------------------------------------------------
    def view(self) -> list[dict[str, Any]]:
        state = self.ledger.state()
        reserved = self.reservations(state)
        total = sum(live.generated_tokens for live in self.live.values()) or 1
        runs = sorted(set(reserved) | {run for run, live in self.live.items() if live.requests})
        now = time.monotonic()
        rows = []
        for run in runs:
            live = self.get(run)
            record = state.runs.get(run)
            rows.append({
                "run": run, "registered": record is not None, "slots": reserved.get(run, 0),
                "max_staleness": record.max_staleness if record else None,
                "weight": record.weight if record else 1.0, "paused": record.paused if record else None,
                "adapters": [run_of(name)[1] for name, entry in state.adapters.items() if entry.run == run],
                "inflight": live.inflight, "requests": live.requests, "prompt_tokens": live.prompt_tokens,
                "generated_tokens": live.generated_tokens, "share": round(live.generated_tokens / total, 4),
                "idle_s": round(now - live.last_seen, 1),
                "lease_left_s": None if run == DEFAULT_RUN else round(
                    max(self.settings.run_lease_s - (now - live.last_seen), 0.0), 1),
            })
        return rows


def foreign_name(run: str, name: str) -> bool:
    """A name the run may not load or unload: it is (or looks like) another run's qualified name."""
    return run_of(name)[0] != DEFAULT_RUN or (run != DEFAULT_RUN and RUN_SEPARATOR in name)

