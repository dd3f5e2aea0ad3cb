"""The proxy's own error answers, in vLLM's body (`{"error": {"message", "type", "param", "code"}}`).

One module for both planes: the front (rollouts) and the admin plane (broadcasts, views) answer the same way,
so a client that reads vLLM's errors reads the proxy's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from lorafleet.vllm_api import VLLMError, error_body

from .replica_state import Replica

MAX_REPORTED_ERRORS = 5
MAX_ERROR_CHARS = 300


def error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    """A vLLM-style JSON error produced by the proxy itself."""
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


def bad_request(message: str, param: str | None = None) -> JSONResponse:
    return error(400, message, "Bad Request", param)


def model_not_found(model: str) -> JSONResponse:
    """vLLM's 404 for a model it does not serve (the front's answer for a name no ready replica holds)."""
    return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def not_held_yet(model: str) -> JSONResponse:
    """503 for an adapter in the ledger that no ready replica holds at this moment (a restarted proxy re-syncing its
    replicas, a replica caught up to an older ledger): it exists and will be served again, so the client retries;
    a 404 would tell it the name is gone and end its run."""
    return error(503, f"The model `{model}` is in the fleet's ledger but no ready replica holds it yet (replicas are "
                 "being synced to the ledger); retry", "ServiceUnavailable", "model")


def adapter_not_found(name: str) -> JSONResponse:
    """vLLM's 404 for an unload of a name it does not hold."""
    return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")


def relay(exc: VLLMError, context: str) -> JSONResponse:
    """A replica's failure with its own status, type and message, plus what the proxy did about it."""
    status = exc.status or 502
    error_type = exc.error_type if exc.status else "BadGateway"
    return error(status, f"{exc.message} [proxy: {context}]", error_type)


class FleetStates(Protocol):
    """What the fleet's 503s tell of it (fleet.Fleet is one): its replicas' states, why its ledger is rebuilt."""

    @property
    def replicas(self) -> Mapping[str, Replica]: ...

    @property
    def unreadable_reason(self) -> str: ...


def no_ready_replica(fleet: FleetStates) -> JSONResponse:
    states = {replica.url: replica.state.value for replica in fleet.replicas.values()}
    return error(503, f"no ready replica in the fleet: {states}", "ServiceUnavailable")


def rebuilding(fleet: FleetStates) -> JSONResponse:
    return error(503, f"the fleet ledger is being rebuilt from the replicas (the file was unusable: "
                 f"{fleet.unreadable_reason}); retry once a replica answers", "ServiceUnavailable")


def ledger_failed(exc: Exception, undone: str) -> JSONResponse:
    """500: the ledger could not be written (`exc`: ledger.LedgerWriteError), and what was undone."""
    return error(500, f"{exc}; {undone}", "LedgerWriteError")


def _param(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


async def validation_error(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's request-validation failure as vLLM answers it: 400, `"type": "Bad Request"`, `param` the field.

    The message is bounded (a huge bad body must not come back amplified) and never echoes the input.
    """
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    shown = [f"{_param(e.get('loc', ()))}: {e.get('msg', '')}"[:MAX_ERROR_CHARS] for e in errors[:MAX_REPORTED_ERRORS]]
    more = f" (and {len(errors) - len(shown)} more)" if len(errors) > len(shown) else ""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}: " + "; ".join(shown) + more if errors else "Validation error"
    param = _param(errors[0].get("loc", ())) if errors else None
    return bad_request(message, param)
