"""Samples the fleet while the nemesis works, for the checker's fleet invariants (observed.jsonl).

Two kinds of line, in time order:
- the ledger each time it changed, `{"time": t, "ledger": {name: fingerprint}}`: the ledger's file is read every
  LEDGER_S (readable while the proxy is down), so a version that lived a second in it is seen;
- a fleet sample once a second: the ledger as well, and under `held` the chaos runs' adapters each replica serves as
  it lists them itself (/v1/models, asked directly, not through the relay, ready or not; null when it does not
  answer), `listed_at` when each was asked and `pids` which process then served its port (the harness's slot: a
  restart is a new pid). `replicas` is `held` for the replicas the proxy calls ready, null for the others.
Replicas are keyed by the URL the proxy knows them by (their relay), the one the provenance headers name. The last
line is a fleet sample taken after every fault has healed and every replica in the fleet is ready again.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from lorafleet.ledger_format import LedgerFileError, ledger_path, read
from lorafleet.runs import run_of

SAMPLE_S = 1.0
LEDGER_S = 0.05


class Observer:
    def __init__(self, root: Path, proxy_url: str, replicas: dict[str, str], runs: tuple[str, ...], out: Path,
                 pid_of: Callable[[str], int | None] = lambda relay: None) -> None:
        """`replicas` maps the URL the proxy knows a replica by (its relay) to the replica's own URL: every slot,
        scaled down or not (one scaled down does not answer). `pid_of(relay)` is the process serving that slot now
        (None when none is)."""
        self.root, self.proxy_url, self.replicas, self.runs, self.out = root, proxy_url, replicas, runs, out
        self.pid_of = pid_of
        self._halt = threading.Event()
        self._write = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name="chaos-observer", daemon=True),
                         threading.Thread(target=self._ledger_loop, name="chaos-ledger-watch", daemon=True)]
        self._client = httpx.Client(timeout=2.0)

    def start(self) -> Observer:
        for thread in self._threads:
            thread.start()
        return self

    def halt(self) -> None:
        self._halt.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def ready(self) -> set[str]:
        """The relay URLs the proxy calls ready now (none when the proxy does not answer)."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            fleet = self._client.get(self.proxy_url + "/fleet").json()
            return {replica["url"] for replica in fleet["replicas"] if replica["state"] == "ready"}
        return set()

    def ledger(self) -> dict[str, str]:
        with contextlib.suppress(LedgerFileError, OSError):
            state = read(ledger_path(self.root), self.root)
            return {name: entry.fingerprint for name, entry in (state.adapters.items() if state else ())}
        return {}

    def sample(self) -> dict[str, Any]:
        ledger = self.ledger()
        ready = self.ready()
        held: dict[str, list[str] | None] = {}
        listed_at: dict[str, float] = {}
        pids: dict[str, int | None] = {}
        for relay, own in self.replicas.items():
            pids[relay], listed_at[relay] = self.pid_of(relay), round(time.time(), 3)
            held[relay] = self._served(own)
        return {"time": round(time.time(), 3), "ledger": ledger,
                "replicas": {relay: names if relay in ready else None for relay, names in held.items()},
                "held": held, "listed_at": listed_at, "pids": pids}

    def record(self) -> dict[str, Any]:
        sample = self.sample()
        self._append(sample)
        return sample

    def _append(self, line: dict[str, Any]) -> None:
        with self._write, open(self.out, "a", encoding="utf-8") as lines:
            lines.write(json.dumps(line) + "\n")

    def _served(self, url: str) -> list[str] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return sorted(card["id"] for card in self._client.get(url + "/v1/models").json()["data"]
                          if card.get("parent") and run_of(card["id"])[0] in self.runs)
        return None

    def _loop(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self.record()

    def _ledger_loop(self) -> None:
        last: dict[str, str] | None = None
        while not self._halt.wait(LEDGER_S):
            at, ledger = round(time.time(), 3), self.ledger()
            if ledger != last:
                self._append({"time": at, "ledger": ledger})
                last = ledger
