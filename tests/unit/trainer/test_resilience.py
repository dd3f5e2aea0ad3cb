"""TRL's control calls survive a proxy that refuses connections for a moment (a restart)."""

from __future__ import annotations

import http.server
import logging
import threading
import time

import pytest
import requests
from lorafleet.ports import free_port
from lorafleet_trainer.resilience import retry_control_calls, retrying_session


class _Pause(http.server.BaseHTTPRequestHandler):
    calls: list[str] = []  # noqa: RUF012 - shared on purpose: the test reads what the server saw

    def do_POST(self) -> None:
        _Pause.calls.append(self.path)
        body = b'{"status":"paused"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_pause_waits_for_a_restarting_proxy(monkeypatch):
    from trl.experimental.async_grpo import vllm_client

    monkeypatch.setattr(vllm_client, "requests", vllm_client.requests)  # restored after the test
    port = free_port()  # nothing listens yet: connections are refused, as during a proxy restart
    retry_control_calls(retrying_session(connect_retries=8, backoff_s=0.2))

    real = http.server.HTTPServer(("127.0.0.1", port), _Pause, bind_and_activate=False)

    def start_late() -> None:
        time.sleep(1.0)
        real.server_bind()
        real.server_activate()
        real.serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    _Pause.calls.clear()
    try:
        vllm_client.VLLMClient(f"http://127.0.0.1:{port}").pause()
    finally:
        real.shutdown()
    assert _Pause.calls == ["/pause?mode=keep"]


class _DiesOnce(_Pause):
    """A proxy killed with the call in flight: the first request's connection closes without an answer."""

    failed = False

    def do_POST(self) -> None:
        if not _DiesOnce.failed:
            _DiesOnce.failed = True
            self.close_connection = True
            return  # no status line: the client reads a connection closed before any answer
        super().do_POST()


class _RolledBackOnce(_Pause):
    """A load whose only ready replica died mid-broadcast: the proxy rolled it back and answered 502, once."""

    failed = False

    def do_POST(self) -> None:
        if not _RolledBackOnce.failed:
            _RolledBackOnce.failed = True
            body = b'{"error":{"message":"1/1 replica(s) failed to load","type":"Bad Gateway","code":502}}'
            self.send_response(502)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_POST()


@pytest.mark.parametrize(("proxy", "call", "path"), [
    (_DiesOnce, lambda client: client.pause(), "/pause?mode=keep"),
    (_RolledBackOnce, lambda client: client.load_lora_adapter("trl-policy-v2", "/x"), "/v1/load_lora_adapter"),
], ids=["connection-lost-before-the-answer", "load-rolled-back-502"])
def test_a_call_that_did_nothing_is_sent_again(monkeypatch, proxy, call, path):
    from trl.experimental.async_grpo import vllm_client

    monkeypatch.setattr(vllm_client, "requests", vllm_client.requests)  # restored after the test
    retry_control_calls(retrying_session(connect_retries=3, backoff_s=0.05))
    server = http.server.HTTPServer(("127.0.0.1", 0), proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Pause.calls.clear()
    try:
        call(vllm_client.VLLMClient(f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()
    assert proxy.failed and _Pause.calls == [path]


def test_without_retries_the_same_refusal_is_fatal():
    port = free_port()
    with pytest.raises(requests.ConnectionError):
        requests.post(f"http://127.0.0.1:{port}/pause", timeout=2)


def test_every_retry_of_a_control_call_is_logged_as_a_wait_for_the_fleet(monkeypatch):
    """urllib3's own retry warnings reach only the NullHandler it installs: a sync that met a stopped proxy waited
    without a line. Each retry is logged on the trainer's logger, naming the call and what failed."""
    from trl.experimental.async_grpo import vllm_client

    monkeypatch.setattr(vllm_client, "requests", vllm_client.requests)  # restored after the test
    retry_control_calls(retrying_session(connect_retries=2, backoff_s=0.01))
    port = free_port()  # nothing listens: the proxy stopped
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("lorafleet_trainer.resilience")  # on it: its parent may not propagate (configure())
    logger.addHandler(handler)
    try:
        with pytest.raises(requests.ConnectionError):
            vllm_client.VLLMClient(f"http://127.0.0.1:{port}").pause()
    finally:
        logger.removeHandler(handler)
    waits = [record for record in records if record.getMessage() == "control_call_waiting"]
    assert len(waits) == 2 and all(record.levelno == logging.WARNING for record in waits), records
    fields = waits[0].fields  # type: ignore[attr-defined]
    assert fields["call"] == "POST /pause?mode=keep" and "ConnectionError" in fields["cause"]
    assert "waiting for the fleet" in fields["reason"] and fields["attempt"] == 1
