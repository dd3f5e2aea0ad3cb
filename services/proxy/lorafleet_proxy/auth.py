"""Which port a request came in on, and the public port's bearer key.

The fleet port (the trainer's) needs no credentials and is reachable only from the fleet network; the public
port wraps the same app in `BearerAuth` and marks each request it lets through, so routes can treat operators'
calls apart (pause elision, /v1/models listing every run).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error

PUBLIC_PORT_SCOPE_KEY = "lorafleet.public_port"  # set in the scope of every request that came in on the public port


def on_public_port(scope: Scope) -> bool:
    return bool(scope.get(PUBLIC_PORT_SCOPE_KEY))


class BearerAuth:
    """The public port: every request needs `Authorization: Bearer <PROXY_API_KEY>` (401 vLLM-style otherwise)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: a valid 'Authorization: Bearer <key>' header is required"
                await error(401, message, "Unauthorized")(scope, receive, send)
                return
            scope = {**scope, PUBLIC_PORT_SCOPE_KEY: True}
        await self.app(scope, receive, send)
