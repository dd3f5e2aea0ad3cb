"""Light completion traffic in a thread: a user evaluating while the fleet changes (the stack test), or the load a
replica's CPU use is measured under (bench/replica_cpu_bench.py).

One short greedy completion at a time, then `every_s` of rest: a few a second, not back to back. On a 2-core machine
a saturating loop starved a starting replica's imports (7 minutes to come up), which is what neither user wants.
"""

from __future__ import annotations

import threading
import time

import httpx


class Traffic:
    """Completions at `url` (`/v1/completions`, 4 tokens, temperature 0) in a thread, from `with` to its end.

    Each prompt is `"<n> <prompt>"` with n the count sent so far: a different prompt each time, spread over the
    replicas as evaluation traffic is. Bounded: stops at the end of the `with` or after `limit_s`. The latency of
    every 200 is kept in `latencies`; every other answer, and every transport error, in `failures`.
    """

    def __init__(self, url: str, model: str, prompt: str, *, api_key: str | None = None, every_s: float = 0.25,
                 limit_s: float | None = None, timeout_s: float = 300) -> None:
        self.url, self.model, self.prompt = url, model, prompt
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.every_s, self.limit_s, self.timeout_s = every_s, limit_s, timeout_s
        self.sent = 0
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 60)

    def _run(self) -> None:
        deadline = None if self.limit_s is None else time.monotonic() + self.limit_s
        with httpx.Client(headers=self.headers, timeout=self.timeout_s) as client:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                body = {"model": self.model, "prompt": f"{self.sent} {self.prompt}", "max_tokens": 4,
                        "temperature": 0.0}
                started = time.monotonic()
                try:
                    response = client.post(self.url + "/v1/completions", json=body)
                    if response.status_code == 200:
                        self.latencies.append(time.monotonic() - started)
                    else:
                        self.failures.append(f"{response.status_code} {response.text[:300]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.sent += 1
                self._stop.wait(self.every_s)
