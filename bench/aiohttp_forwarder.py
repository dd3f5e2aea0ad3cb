"""The baseline of the throughput benchmark: the thinnest aiohttp forwarder (buffer, forward to one upstream).

No routing, no validation, no metrics. Usage: python bench/aiohttp_forwarder.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys

import aiohttp
import uvloop
from aiohttp import web


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app["session"].post(upstream + request.path, data=body,
                                               headers={"content-type": "application/json"}) as answer:
            return web.Response(body=await answer.read(), status=answer.status,
                                content_type=answer.content_type)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    uvloop.install()
    web.run_app(make_app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
