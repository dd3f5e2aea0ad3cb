"""One request on the relay path, as the front made it: what every step after routing reads.

`RelayedRequest` is built once where a request enters the front (front.py) and carried through routing, the relay's
retries, each attempt on a replica and its accounting, instead of a dozen parameters threaded through each call.
Slotted, and read-only by convention: a request's facts do not change on the way (nothing assigns to one after the
front made it). Not `frozen=True`: a frozen dataclass's `__init__` sets each field through `object.__setattr__`, which
on every request costs more than all the arguments it replaces (bench/hotpath_bench.py measures the path).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from .router import Prompt
from .runs import NameMap, Turn


@dataclass(slots=True)
class RelayedRequest:
    """A request the front relays to one replica (a generation, or a read-only helper)."""

    scope: Scope
    receive: Receive
    send: Send  # counts the answer's status (Front.__call__)
    method: str
    path: str  # the route, without a run's /runs/<run> prefix
    target: str  # what the replica is asked for: the path and the query string
    raw: bytes  # the body as forwarded (a run's names already made fleet-unique)
    run: str
    # Generations only (a read-only helper leaves them empty: no routing, no provenance, no fair share).
    adapter: str = ""  # the weights asked for, by fleet-unique name ("" or the base model's name: no adapter)
    shown: str = ""  # the model as the client named it (a 404 names it so)
    stream: bool = False
    prompts: list[Prompt] | None = None  # the routing blocks; None: the least loaded replica, no routing
    names: NameMap | None = None  # the run's names written back into the answer
    turn: Turn | None = None  # the fair-share turn (runs share the fleet): its replica goes first

    @property
    def generation(self) -> bool:
        """A routed generation: its answer carries provenance and the circuit breaker counts it."""
        return self.prompts is not None

    @property
    def answers(self) -> list[bytes] | None:
        """Where a non-streamed answer's body goes for the run's token counts (None: nobody counts them)."""
        return self.turn.answers if self.turn is not None else None
