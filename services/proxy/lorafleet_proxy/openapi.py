"""The proxy's OpenAPI document (`GET /openapi.json`): what the proxy really accepts, on both ports.

FastAPI describes the admin routes from their typed requests. The routes the front relays itself (generation,
the read-only helpers) are mounted as FastAPI routes too (`relayed_router`), so they are documented and the
front knows them by path, but the front serves them before FastAPI sees them. The generation routes read their
body themselves (no parsing cost on the hot path), so their documented bodies come from
`schemas.GENERATION_BODIES` through stand-in routes that exist only in the document. Validation
failures are documented as vLLM's 400 error body, not FastAPI's 422.
"""

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel

from .errors import error
from .front import READ_ONLY_ROUTES, ROUTES
from .schemas import GENERATION_BODIES

DESCRIPTION = (
    "One vLLM server (data_parallel_size 1) in front of a fleet of vLLM replicas. The fleet port needs no "
    "credentials and must be reachable only from the fleet network; the public port answers 401 to every "
    "request without `Authorization: Bearer <PROXY_API_KEY>`. Errors use vLLM's body: "
    '{"error": {"message", "type", "param", "code"}}.'
)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """vLLM's error body, used for every error the proxy produces itself."""

    error: ErrorInfo


async def relayed_route(request: Request) -> Response:
    """vLLM's call, relayed to one replica: generation by prefix affinity, helpers to the least loaded."""
    return error(500, f"{request.url.path} must be served by the proxy's front", "InternalServerError")


# (path, method, handler) or (path, method, handler, operation id); without an id FastAPI derives it from the
# handler's name, path and method, and the summary and description from its name and docstring.
Route = tuple[str, str, Callable[..., Any]] | tuple[str, str, Callable[..., Any], str]


def mount(routes: Iterable[Route]) -> APIRouter:
    """A router for a table of routes (the admin plane's, the views', the relayed ones)."""
    router = APIRouter()
    for path, method, handler, *operation_id in routes:
        router.add_api_route(path, handler, methods=[method], operation_id=operation_id[0] if operation_id else None)
    return router


def relayed_router() -> APIRouter:
    """The routes the front relays to one replica, as FastAPI knows them (documentation, the front's route set)."""
    return mount([*((path, "POST", relayed_route) for path in ROUTES),
                  *((path, method, relayed_route) for path, method in READ_ONLY_ROUTES.items())])


def _stand_in(model: type[BaseModel]) -> Any:
    """A route function whose only job is to carry `model` as its documented body."""

    async def generate(body: Any) -> Response:  # pragma: no cover - never served
        raise NotImplementedError

    body = inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=model)
    generate.__signature__ = inspect.Signature([body], return_annotation=Response)  # type: ignore[attr-defined]
    return generate


def document(app: FastAPI) -> dict[str, Any]:
    """Build (once) and return the document served at /openapi.json."""
    if app.openapi_schema is None:
        stand_ins = APIRouter()
        for path, model in GENERATION_BODIES.items():
            stand_ins.add_api_route(path, _stand_in(model), methods=["POST"], summary=model.__doc__)
        routes = [route for route in app.routes if getattr(route, "path", None) not in GENERATION_BODIES]
        schema = get_openapi(title=app.title, version="1", description=DESCRIPTION, routes=routes + stand_ins.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")["$defs"])
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas["ErrorResponse"].pop("$defs")
        bad_request = {"description": "Bad Request: vLLM's error body",
                       "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for operations in schema["paths"].values():
            for operation in operations.values():
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"]["400"] = bad_request
        app.openapi_schema = schema
    return app.openapi_schema
