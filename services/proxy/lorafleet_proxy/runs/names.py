"""A run's names on the shared fleet: its URL prefix, its adapters' fleet-unique names, and the one path that
writes the run's own names back into whatever it is answered (bodies, streams, errors).

Run `b`'s adapter `trl-policy-v3` is `b--trl-policy-v3` on the replicas and in the ledger (`lorafleet.runs.qualify`).
Names go in at the proxy (load, unload, generation `model`) and come back out through `NameMap`, whoever made the
answer: a replica (relayed whole or streamed) or the proxy itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import Response
from lorafleet.runs import DEFAULT_RUN, RUN_SEPARATOR, RUN_URL_PREFIX, check_run_name, run_of
from starlette.types import Scope

from ..errors import error

RUN_SCOPE_KEY = "lorafleet.run"  # set by the front on every request under /runs/<run>/: the run it belongs to


def split_run_path(path: str) -> tuple[str, str]:
    """`/runs/<run>/<rest>` -> (run, `/<rest>`); raises RunNameError for a malformed run name."""
    run, _, rest = path[len(RUN_URL_PREFIX):].partition("/")
    return check_run_name(run), "/" + rest


def run_of_scope(scope: Scope) -> str:
    """The run a request belongs to (the default run without a /runs/<run>/ prefix)."""
    return scope.get(RUN_SCOPE_KEY, DEFAULT_RUN)  # type: ignore[no-any-return]


def foreign_name(run: str, name: str) -> bool:
    """A name the run may not load or unload: it is (or looks like) another run's qualified name."""
    return run_of(name)[0] != DEFAULT_RUN or (run != DEFAULT_RUN and RUN_SEPARATOR in name)


def own_name(qualified: str) -> str:
    """The name the run that owns `qualified` knows it by."""
    return run_of(qualified)[1]


def not_its_own(run: str, name: str) -> Response:
    """The 400 for a load naming another run's adapter."""
    where = "another run's adapter name" if run == DEFAULT_RUN else f"not a name of run {run!r}"
    return error(400, f"invalid adapter name {name!r}: {where} (names with '--' are run-qualified; a run "
                 "reaches its own adapters under /runs/<run>/)", "InvalidUserInput")


@dataclass(frozen=True, slots=True)
class NameMap:
    """A fleet-unique adapter name and the run's own name for it, written back in everything the run is answered."""

    qualified: bytes
    own: bytes

    @classmethod
    def of(cls, qualified: str, own: str) -> NameMap | None:
        """The map between two names; None when they are the same (the default run: nothing to rewrite)."""
        return None if qualified == own else cls(qualified.encode(), own.encode())

    def body(self, content: bytes) -> bytes:
        return content.replace(self.qualified, self.own)

    def response(self, response: Response) -> Response:
        """A proxy-made answer (not streamed) with the run's name in place of the fleet-unique one."""
        headers = {key: value for key, value in response.headers.items() if key != "content-length"}
        return Response(self.body(bytes(response.body)), response.status_code, headers)

    def stream(self) -> StreamRename:
        return StreamRename(self)


class StreamRename:
    """Renames a stream chunk by chunk: a tail that could be the start of a name split across chunks waits for
    the next chunk (or the end)."""

    __slots__ = ("keep", "names", "pending")

    def __init__(self, names: NameMap) -> None:
        self.names = names
        self.keep = len(names.qualified) - 1
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """What can be sent of the stream so far (maybe nothing)."""
        pending = self.names.body(self.pending + chunk)
        cut = max(len(pending) - self.keep, 0)
        self.pending = pending[cut:]
        return pending[:cut]

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest
