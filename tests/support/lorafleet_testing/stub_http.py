"""A stdlib HTTP handler base for unit tests that stand in for a server over real HTTP (a proxy, a replica)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonStub(BaseHTTPRequestHandler):
    """Reads JSON bodies, answers JSON, logs nothing."""

    def json_body(self) -> dict[str, Any]:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def answer(self, payload: dict[str, Any], headers: dict[str, str] | None = None, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass
