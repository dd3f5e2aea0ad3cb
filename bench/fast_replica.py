"""A fake vLLM replica that answers /v1/completions at once (the throughput benchmark's upstream).

Everything else (health, server_info, adapters) is the test suite's FakeReplica, so the proxy syncs
with it as with a real replica. Usage: python bench/fast_replica.py PORT
"""

from __future__ import annotations

import sys

import orjson
import uvicorn
from lorafleet_testing.fakes import FakeReplica
from starlette.types import ASGIApp, Receive, Scope, Send

ANSWER = orjson.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "fake-base",
                       "choices": [{"index": 0, "text": " fake", "token_ids": [7, 8, 9], "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 200, "completion_tokens": 3, "total_tokens": 203}})
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


def fast(app: ASGIApp) -> ASGIApp:
    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            message = await receive()
            while message.get("more_body"):
                message = await receive()
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            await send({"type": "http.response.body", "body": ANSWER})
            return
        await app(scope, receive, send)

    return serve


if __name__ == "__main__":
    uvicorn.run(fast(FakeReplica().app()), host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop",
                http="httptools", log_level="warning", access_log=False)
