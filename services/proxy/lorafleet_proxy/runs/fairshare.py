"""Fair share of generation between runs: a virtual token counter (VTC) queue at the proxy.

vLLM schedules first come, first served, so a run with four times the requests in flight would get four
times the tokens. While several runs share the fleet, the proxy lets at most a window of requests
through (PROXY_FAIR_INFLIGHT_PER_REPLICA per ready replica) and queues the rest per run. Each run has a
counter of the tokens it was served divided by its weight; when a slot frees, the backlogged run with the
lowest counter goes next (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24). A request
is charged its estimate at dispatch (prompt tokens + max_tokens) and corrected to its prompt plus the tokens it
really generated when it completes, so short answers are not over-charged. A run that becomes backlogged is lifted
to the lowest counter of the runs with work, so idle time is not banked into a burst that starves others.
Nothing is refused: requests wait. A lone run never waits behind anyone, and with a single run (no
named run registered) the front does not enter the scheduler at all.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions when the request names none


@dataclass
class Queue:
    """One run's waiting requests and its virtual counter (tokens served / weight)."""

    weight: float = 1.0
    counter: float = 0.0
    inflight: int = 0
    waiting: deque[tuple[asyncio.Future[None], int]] = field(default_factory=deque)  # (turn, its estimate)


class FairShare:
    """Admits generation requests into a bounded window, backlogged runs in order of their virtual counters."""

    def __init__(self, window: Callable[[], int]) -> None:
        self.window = window  # how many requests may be in flight on the fleet now
        self.queues: dict[str, Queue] = {}
        self.inflight = 0

    def queue(self, run: str, weight: float) -> Queue:
        queue = self.queues.get(run)
        if queue is None:
            queue = self.queues[run] = Queue(weight)
        queue.weight = weight
        return queue

    def _active_floor(self, exclude: Queue) -> float | None:
        counters = [q.counter for q in self.queues.values() if q is not exclude and (q.waiting or q.inflight)]
        return min(counters) if counters else None

    async def enter(self, run: str, weight: float, estimate: int) -> float:
        """Wait for this request's turn; returns the seconds it waited. Charge `estimate` tokens at dispatch."""
        queue = self.queue(run, weight)
        if not queue.waiting and not queue.inflight:
            floor = self._active_floor(queue)
            if floor is not None and floor > queue.counter:
                queue.counter = floor  # no credit for the time it was idle
        started = time.monotonic()
        if self.inflight >= self.window() or any(q.waiting for q in self.queues.values()):
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            turn = (future, estimate)
            queue.waiting.append(turn)
            self._dispatch()
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release(queue, estimate)  # admitted just as the client left: give the slot back
                elif turn in queue.waiting:
                    queue.waiting.remove(turn)
                raise
        else:
            self._admit(queue, estimate)
        return time.monotonic() - started

    def leave(self, run: str, estimate: int, used: int | None) -> None:
        """The request is done: correct its charge to the tokens it used (None = unknown), free its slot."""
        queue = self.queues[run]
        if used is not None:
            queue.counter += (used - estimate) / queue.weight
        queue.inflight -= 1
        self.inflight -= 1
        self._dispatch()

    def _admit(self, queue: Queue, estimate: int) -> None:
        """Charged at admission, so the next choice (even in the same dispatch round) sees this one."""
        queue.inflight += 1
        self.inflight += 1
        queue.counter += estimate / queue.weight

    def _release(self, queue: Queue, estimate: int) -> None:
        queue.counter -= estimate / queue.weight
        queue.inflight -= 1
        self.inflight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self.inflight < self.window():
            backlogged = [q for q in self.queues.values() if q.waiting]
            if not backlogged:
                return
            queue = min(backlogged, key=lambda q: q.counter)
            future, estimate = queue.waiting.popleft()
            if future.done():  # its client left while it waited
                continue
            self._admit(queue, estimate)
            future.set_result(None)

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
