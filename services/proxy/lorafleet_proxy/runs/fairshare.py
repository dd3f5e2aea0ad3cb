"""Fair share of generation between runs: a virtual token counter (VTC) queue at the proxy, admitting per replica.

While several runs share the fleet, each ready replica gets at most its window of requests (its batch,
PROXY_FAIR_INFLIGHT_PER_REPLICA, plus a pipeline, PROXY_FAIR_PIPELINE_PER_REPLICA, that waits in its engine) and the
rest queue per run. When a replica has room, the backlogged run with the lowest counter (tokens served / weight)
goes next (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): charged prompt + max_tokens at
dispatch, corrected to the tokens really generated; a newly backlogged run is lifted to the lowest busy counter (no
banked credit). A request is placed when admitted: its candidates are narrowed to the replicas with room and the
front's router picks among them, so no replica with room idles while a request it can serve waits. A request with no
candidate at all is let through at once (the front answers why); a lone run never waits, and a single-run fleet never
enters the scheduler. Why per replica and why the pipeline: docs/concepts/runs.md ("Fair share").
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions when the request names none


@dataclass(eq=False)
class Ticket:
    """One request's place: its estimate, how to place it, and where it was placed."""

    run: str
    estimate: int
    candidates: Callable[[], Sequence[str]]  # the replicas (URLs) that can serve it, asked when a slot is free
    choose: Callable[[list[str]], str]  # the front's router: one of the candidates with room
    replica: str | None = None  # where it holds its slot (None: not admitted yet, or no replica can serve it)
    admitted: bool = False
    future: asyncio.Future[None] | None = field(default=None, repr=False)


@dataclass
class Queue:
    """One run's waiting requests and its virtual counter (tokens served / weight)."""

    weight: float = 1.0
    counter: float = 0.0
    inflight: int = 0
    waiting: deque[Ticket] = field(default_factory=deque)


class FairShare:
    """Admits generation requests onto replicas, at most `window()` each, backlogged runs in order of their virtual
    counters."""

    def __init__(self, window: Callable[[], int]) -> None:
        self.window = window  # how many requests may be in flight on one replica
        self.queues: dict[str, Queue] = {}
        self.placed: dict[str, int] = {}  # replica URL -> admitted requests holding one of its slots

    def queue(self, run: str, weight: float) -> Queue:
        queue = self.queues.get(run)
        if queue is None:
            queue = self.queues[run] = Queue(weight)
        queue.weight = weight
        return queue

    @property
    def inflight(self) -> int:
        """Admitted requests that have not left, on any replica or none."""
        return sum(queue.inflight for queue in self.queues.values())

    def _active_floor(self, exclude: Queue) -> float | None:
        counters = [q.counter for q in self.queues.values() if q is not exclude and (q.waiting or q.inflight)]
        return min(counters) if counters else None

    async def enter(self, run: str, weight: float, estimate: int, candidates: Callable[[], Sequence[str]],
                    choose: Callable[[list[str]], str]) -> tuple[Ticket, float]:
        """Wait for this request's turn and its replica (`ticket.replica`); returns its ticket and the seconds it
        waited. Charges `estimate` tokens at dispatch."""
        queue = self.queue(run, weight)
        if not queue.waiting and not queue.inflight:
            floor = self._active_floor(queue)
            if floor is not None and floor > queue.counter:
                queue.counter = floor  # no credit for the time it was idle
        ticket = Ticket(run, estimate, candidates, choose)
        started = time.monotonic()
        if any(q.waiting for q in self.queues.values()) or not self._place(queue, ticket):
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ticket.future = future
            queue.waiting.append(ticket)
            self._dispatch()
            try:
                await future
            except asyncio.CancelledError:
                if ticket.admitted:
                    self._leave(queue, ticket, 0)  # admitted just as the client left: the slot and charge go back
                elif ticket in queue.waiting:
                    queue.waiting.remove(ticket)
                raise
        return ticket, time.monotonic() - started

    def leave(self, ticket: Ticket, used: int | None) -> None:
        """The request is done: correct its charge to the tokens it used (None = unknown), free its slot."""
        self._leave(self.queues[ticket.run], ticket, ticket.estimate if used is None else used)

    def move(self, ticket: Ticket, replica: str) -> None:
        """A retry took the request to another replica: its slot goes with it (even past that replica's window: a
        retried request does not queue again)."""
        if ticket.replica == replica:
            return
        self._free(ticket)
        ticket.replica = replica
        self.placed[replica] = self.placed.get(replica, 0) + 1
        self._dispatch()

    def _place(self, queue: Queue, ticket: Ticket) -> bool:
        """Admit `ticket` onto one of its candidates with room (or, having no candidate, onto none); charged at
        admission, so the next choice (even in the same dispatch round) sees it."""
        candidates = ticket.candidates()
        if candidates:
            window = self.window()
            room = [replica for replica in candidates if self.placed.get(replica, 0) < window]
            if not room:
                return False
            ticket.replica = ticket.choose(room)
            self.placed[ticket.replica] = self.placed.get(ticket.replica, 0) + 1
        ticket.admitted = True
        queue.inflight += 1
        queue.counter += ticket.estimate / queue.weight
        return True

    def _free(self, ticket: Ticket) -> None:
        if ticket.replica is None:
            return
        left = self.placed.get(ticket.replica, 0) - 1
        if left > 0:
            self.placed[ticket.replica] = left
        else:
            self.placed.pop(ticket.replica, None)  # a replica that left the fleet leaves no entry behind
        ticket.replica = None

    def _leave(self, queue: Queue, ticket: Ticket, charge: int) -> None:
        queue.counter += (charge - ticket.estimate) / queue.weight
        queue.inflight -= 1
        ticket.admitted = False
        self._free(ticket)
        self._dispatch()

    def _dispatch(self) -> None:
        """Admit waiting requests while some replica they can use has room: the lowest counter first, a run whose
        next request fits nowhere skipped (work-conserving)."""
        while True:
            for queue in sorted((q for q in self.queues.values() if q.waiting), key=lambda q: q.counter):
                ticket = queue.waiting[0]
                assert ticket.future is not None
                if ticket.future.done():  # its client left while it waited
                    queue.waiting.popleft()
                    break
                if self._place(queue, ticket):
                    queue.waiting.popleft()
                    ticket.future.set_result(None)
                    break
            else:
                return

    def waiting(self, run: str) -> int:
        queue = self.queues.get(run)
        return len(queue.waiting) if queue else 0


def prompt_tokens(body: dict[str, object]) -> int:
    """The prompt's length in tokens: token ids counted, text at ~4 bytes per token (an estimate only)."""
    prompt = body.get("prompt", body.get("messages"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return sum(len(item) for item in prompt)
    return len(str(prompt)) // 4 if prompt else 0


def estimate_tokens(body: dict[str, object], prompt: int) -> int:
    """What a request may cost before it ran: its `prompt` tokens plus the tokens it may generate."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
    count = body.get("n") or 1
    generated = max_tokens if isinstance(max_tokens, int) else DEFAULT_MAX_TOKENS
    return prompt + generated * (count if isinstance(count, int) and count > 0 else 1)
