"""`Runs`: the one object that decides about runs. Registrations (in the ledger), live state, pauses, leases,
names in and out, the fair-share turn of a request, the slot budget (budget.py).

The front, the admin plane and the broadcasts ask it; none of them decides anything about runs itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from fastapi.responses import JSONResponse, Response
from lorafleet.adapters import AdapterPathError
from lorafleet.ledger_format import Entry, LedgerState, RunRecord
from lorafleet.runs import DEFAULT_RUN, RUN_URL_PREFIX, qualify, run_of, run_slots
from lorafleet.settings import ProxySettings
from starlette.types import Scope

from ..auth import on_public_port
from ..errors import error, ledger_failed
from ..metrics import Metrics
from ..replica_state import Replica
from .budget import SlotBudget
from .confinement import OutsideRunFolder, confine_load, load_folders
from .fairshare import FairShare, Ticket, estimate_tokens, prompt_tokens
from .key_check import RunKeys
from .names import RUN_SCOPE_KEY, NameMap, own_name, run_of_scope, split_run_path

log = logging.getLogger("lorafleet.proxy.runs")

WAIT_POLL_S = 0.02
FleetCall = Callable[[], Awaitable[Response]]
Unload = Callable[[str, str], Awaitable[None]]  # (adapter, why): broadcast.unload_from_ready on the fleet


class RunsFleet(Protocol):
    """What the runs need of the fleet (fleet.Fleet is one): the ready replicas (their LoRA slots), its lock for a
    change of the ledger, and the ledger's write."""

    def ready(self) -> list[Replica]: ...

    def broadcasting(self) -> AbstractAsyncContextManager[None]: ...

    def commit(self, state: LedgerState) -> Exception | None: ...


class RunsLedger(Protocol):
    """What the runs read of the ledger (ledger.Ledger is one), and its observers, told every state it takes."""

    observers: list[Callable[[LedgerState], None]]
    rebuilding: bool

    def state(self) -> LedgerState: ...

    def entries(self) -> dict[str, Entry]: ...

    def get(self, name: str) -> Entry | None: ...

    def runs(self) -> dict[str, RunRecord]: ...


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


@dataclass(eq=False)
class Turn:
    """A generation request's fair-share turn, as the front holds it: the replica it was admitted onto (None: no
    ready replica can serve it), the answer's body the front appends (token counts), and a retry's move."""

    fair: FairShare
    ticket: Ticket
    answers: list[bytes] = field(default_factory=list)

    @property
    def replica(self) -> str | None:
        return self.ticket.replica

    def moved(self, replica: str) -> None:
        """The request is retried on `replica`: its slot goes there."""
        self.fair.move(self.ticket, replica)


class Runs:
    """The runs sharing the fleet: registrations (in the ledger), live state, budget, pauses and leases."""

    def __init__(self, settings: ProxySettings, fleet: RunsFleet, ledger: RunsLedger, metrics: Metrics,
                 unload: Unload) -> None:
        self.settings = settings
        self.fleet = fleet
        self.unload = unload  # injected: a run's expiry unloads through the broadcasts, which know nothing of runs
        self.ledger = ledger
        self.metrics = metrics
        self.keys = RunKeys(settings.run_keys_dir)
        self.live: dict[str, LiveRun] = {}
        self.slots = SlotBudget(settings, self._capacities, metrics)
        # Per replica: its batch, plus a pipeline waiting in its engine
        # (docs/concepts/runs.md#fair-share-a-virtual-token-counter-queued-at-the-proxy-admitted-per-replica).
        self.fair = FairShare(
            lambda: settings.proxy_fair_inflight_per_replica + settings.proxy_fair_pipeline_per_replica)
        self.foreign: frozenset[str] = frozenset()  # fleet-unique names of named runs' adapters
        self.shared = False  # a named run is registered or holds adapters: pauses, fair share and tokens per run
        self._weights: dict[str, float] = {}
        self.ledger.observers.append(self._observe)
        self._observe(self.ledger.state())

    def _capacities(self) -> list[int]:
        return [r.info.lora.max_loras for r in self.fleet.ready() if r.info is not None and r.info.lora is not None]

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

    @staticmethod
    def under_prefix(scope: Scope) -> bool:
        return scope["path"].startswith(RUN_URL_PREFIX)  # type: ignore[no-any-return]

    def enter(self, scope: Scope) -> Scope:
        """A request under /runs/<run>/: the same route without the prefix, marked with its run, whose lease
        starts over. Raises RunNameError (a 404 for the front) for a malformed run name, RunKeyRefused (401/403)
        for a request without the run's key where runs have keys; either before anything changes."""
        run, path = split_run_path(scope["path"])
        self.keys.check(scope, run)
        self.touch(run)
        return {**scope, "path": path, "raw_path": path.encode(), RUN_SCOPE_KEY: run}

    of = staticmethod(run_of_scope)

    def _observe(self, state: LedgerState) -> None:
        """Follow every ledger change: pause gates, the slot book, the names the default run may not see."""
        self.foreign = frozenset(name for name, entry in state.adapters.items() if entry.run != DEFAULT_RUN)
        self.shared = bool(self.foreign) or any(run != DEFAULT_RUN for run in state.runs)
        self._weights = {run: record.weight for run, record in state.runs.items()}
        self.slots.observe(state)
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

    # --- names in and out ------------------------------------------------------------------------
    qualify = staticmethod(qualify)

    @staticmethod
    def renamed(response: Response, qualified: str, own: str) -> Response:
        """A proxy-made answer about `qualified` with the run's own name written back (the default run: as is)."""
        names = NameMap.of(qualified, own)
        return response if names is None else names.response(response)

    def resolve(self, scope: Scope, model: str) -> tuple[str, NameMap | None] | None:
        """The fleet-unique name a generation request means by `model` and the map back to the run's names; None
        for another run's adapter (as if it did not exist: named runs see only theirs, the default run too but on
        the public port). The base model and unknown names are passed as given."""
        run = run_of_scope(scope)
        if run == DEFAULT_RUN and model not in self.foreign:
            return model, None  # the single-run fleet's path: one set lookup
        if run != DEFAULT_RUN and model:
            qualified = qualify(run, model)
            if self.ledger.get(qualified) is not None:
                return qualified, NameMap.of(qualified, model)
        if model in self.foreign and (run != DEFAULT_RUN or not on_public_port(scope)):
            return None
        return model, None

    def visible_adapters(self, scope: Scope) -> list[tuple[str, str, Entry]]:
        """(fleet-unique name, the name shown, entry) of the adapters a request's /v1/models lists: its run's own
        under their own names; on the public port the default run (operators) sees every run's, qualified."""
        run = run_of_scope(scope)
        every_run = run == DEFAULT_RUN and on_public_port(scope)
        return [(name, name if every_run else own_name(name), entry)
                for name, entry in self.ledger.entries().items() if every_run or entry.run == run]

    def lora_limits(self, scope: Scope, lora: dict[str, Any]) -> None:
        """A named run's /server_info reports its own slots as --max-loras (what TRL checks its staleness on)."""
        run = run_of_scope(scope)
        if run != DEFAULT_RUN:
            lora["max_loras"] = lora["max_cpu_loras"] = self.slots.slots_for(run, self.ledger.state())

    # --- a generation request's turn ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def turn(self, run: str, body: dict[str, Any], candidates: Callable[[], Sequence[str]],
                   choose: Callable[[list[str]], str]) -> AsyncIterator[Turn]:
        """While several runs share the fleet: wait while the run is paused, then for a fair-share turn on a replica
        with room (`candidates`: the ready replicas that can serve the request, asked when one may have room;
        `choose`: the router's pick among those with room), and count the tokens of the answer the caller appends
        to the turn's `answers`."""
        live = self.get(run)
        if not live.running.is_set():
            await live.running.wait()  # the run's pause holds its requests here, never on the replicas
        prompt = prompt_tokens(body)
        estimate = estimate_tokens(body, prompt)
        live.inflight += 1
        live.requests += 1
        try:
            ticket, waited = await self.fair.enter(run, self.weight(run), estimate, candidates, choose)
            self.metrics.run_queue_wait.labels(run).observe(waited)
            turn = Turn(self.fair, ticket)
            try:
                yield turn
            finally:
                generated = self.count_tokens(live, turn.answers[0] if turn.answers else b"")
                self.fair.leave(ticket, None if generated is None else prompt + generated)
        finally:
            live.inflight -= 1

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

    # --- admission -------------------------------------------------------------------------------
    def confine_load(self, scope: Scope, path: str) -> str | JSONResponse:
        """`lora_path` relative to ADAPTER_ROOT, read as written, when a load by the request's run may name it
        (confinement.py): 400 outside the adapter root, 403 outside the run's folder; either before anything changes.
        Nothing is resolved here: the content store's walk opens exactly these names (content_store.py)."""
        run = run_of_scope(scope)
        folders = load_folders(run, self.settings.run_name, self.keys.keyed(), self.keys.owner(scope))
        who = "the default run" if run == DEFAULT_RUN else f"run {run!r}"
        try:
            return str(confine_load(path, self.settings.adapter_root, folders, who))
        except OutsideRunFolder as exc:
            log.warning("load refused run=%s path=%r: outside the run's folder", run, path)
            return error(403, str(exc), "Forbidden", "lora_path")
        except AdapterPathError as exc:
            return error(400, str(exc), "InvalidUserInput", "lora_path")

    def load_admission(self, run: str, qualified: str) -> Callable[[LedgerState], JSONResponse | None]:
        """What a load of `qualified` by `run` checks under the fleet lock: the run fits, and holds no more
        adapters than it reserved (broadcast.load_adapter calls it before touching any replica)."""
        return lambda state: self.slots.admit(state, run) or self.slots.check_load(state, run, qualified)

    def budget(self) -> dict[str, Any]:
        return self.slots.view(self.ledger.state())

    async def register(self, run: str, max_staleness: int, weight: float) -> Response:
        """POST /runs/<run>/register: reserve run_slots(max_staleness) slots (409 when they do not fit); idempotent."""
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            refusal = self.slots.admit(state, run, RunRecord(max_staleness, weight))
            if refusal is not None:
                return refusal
            if not state.same_as(self.ledger.state()) and (failed := self._commit(state)) is not None:
                return failed
        self.touch(run)
        slots = run_slots(max_staleness)
        log.info("run registered run=%s max_staleness=%d weight=%g slots=%d", run, max_staleness, weight, slots)
        return JSONResponse({"run": run, "slots": slots, "weight": weight, "budget": self.budget()})

    def _commit(self, state: LedgerState) -> JSONResponse | None:
        exc = self.fleet.commit(state)
        return None if exc is None else ledger_failed(exc, "nothing changed")

    # --- pauses ----------------------------------------------------------------------------------
    async def pause(self, scope: Scope, mode: str, fleet_pause: FleetCall) -> Response:
        """The default run's pause is the fleet's (`fleet_pause`); a named run's holds that run's new requests at
        the proxy (no replica pauses), and `wait` also waits for its in-flight ones."""
        run = run_of_scope(scope)
        if run == DEFAULT_RUN:
            return await fleet_pause()
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            refusal = self.slots.admit(state, run)
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

    async def resume(self, scope: Scope, fleet_resume: FleetCall) -> Response:
        run = run_of_scope(scope)
        if run == DEFAULT_RUN:
            return await fleet_resume()
        async with self.fleet.broadcasting():
            state = self.ledger.state()
            record = state.runs.get(run)
            if record is not None and record.paused is not None:
                state.runs[run] = RunRecord(record.max_staleness, record.weight, None)
                if (failed := self._commit(state)) is not None:
                    return failed
        log.info("run resumed run=%s", run)
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, scope: Scope, fleet_is_paused: FleetCall) -> Response:
        """A named run's own pause (held at the proxy); the default run asks the replicas (`fleet_is_paused`)."""
        run = run_of_scope(scope)
        if run == DEFAULT_RUN:
            return await fleet_is_paused()
        record = self.ledger.runs().get(run)
        return JSONResponse({"is_paused": record is not None and record.paused is not None})

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
                await self.unload(name, f"run {run} expired")
        self.live.pop(run, None)
        for per_run in (self.metrics.run_slots, self.metrics.run_adapters, self.metrics.run_inflight,
                        self.metrics.run_share):
            with contextlib.suppress(KeyError):
                per_run.remove(run)
        self.metrics.run_expirations.inc()
        log.warning("run expired run=%s reason=%s unloaded=%s (slots returned)", run, why, names)
        return True

    # --- operators' view -------------------------------------------------------------------------
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

    def view(self) -> list[dict[str, Any]]:
        state = self.ledger.state()
        reserved = self.slots.reservations(state)
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
