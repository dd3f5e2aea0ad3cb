"""An HTTP relay in front of the proxy that holds one adapter load: a sync frozen at a point the test chose.

A kill "during a sync" by polling for the adapter folder is a race: the folder appears, then the trainer loads it,
resumes the fleet and deletes an old folder within a few milliseconds, and a loaded machine's test process misses
the window. Behind this relay the trainer blocks in its `/v1/load_lora_adapter` call (the folder written, nothing
deleted yet) until the test has killed it. Everything else is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import uvicorn
from lorafleet.ports import free_port
from lorafleet.vllm_api import replica_limits
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

LOAD_PATH = "/v1/load_lora_adapter"
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class LoadGate:
    """Relay to `upstream`; a load whose `lora_name` satisfies `hold` waits until the gate closes (then 503)."""

    def __init__(self, upstream: str, hold: Callable[[str], bool]) -> None:
        self.upstream, self.hold = upstream.rstrip("/"), hold
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.held = threading.Event()
        self.held_name: str | None = None
        self._release: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self._loop, self._release = asyncio.get_running_loop(), asyncio.Event()
        async with httpx.AsyncClient(timeout=None, limits=replica_limits()) as self._client:
            yield

    async def _relay(self, request: Request) -> Response:
        assert self._client is not None and self._release is not None
        body = await request.body()
        name = str(json.loads(body or b"{}").get("lora_name", "")) if request.url.path == LOAD_PATH else None
        if name is not None and self.hold(name):
            self.held_name = name
            self.held.set()
            await self._release.wait()
            return JSONResponse({"error": {"message": "held by the test's gate", "code": 503}}, status_code=503)
        headers = {key: value for key, value in request.headers.items() if key.lower() not in HOP_HEADERS}
        answer = await self._client.request(request.method, self.upstream + request.url.path,
                                            params=request.query_params, content=body, headers=headers)
        return Response(answer.content, answer.status_code,
                        {key: value for key, value in answer.headers.items() if key.lower() not in HOP_HEADERS})

    @contextlib.contextmanager
    def running(self) -> Iterator[LoadGate]:
        """Serve on 127.0.0.1:`port` in a thread; on exit, answer the held load (if any) and stop."""
        app = Starlette(routes=[Route("/{path:path}", self._relay, methods=["GET", "POST", "DELETE", "PUT"])],
                        lifespan=self._lifespan)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="load-gate", daemon=True)
        thread.start()
        while not server.started:
            assert thread.is_alive(), "the load gate failed to start"
            threading.Event().wait(0.01)
        try:
            yield self
        finally:
            if self._loop is not None and self._release is not None:
                self._loop.call_soon_threadsafe(self._release.set)
            server.should_exit = True
            thread.join(timeout=30)
