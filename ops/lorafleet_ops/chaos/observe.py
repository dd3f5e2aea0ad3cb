"""Samples the fleet while the nemesis works, for the checker's fleet invariants (observed.jsonl).

Each sample: the ledger as its file holds it (name -> fingerprint; readable while the proxy is down), and under
`held` the chaos runs' adapters each replica serves as it lists them itself (/v1/models, asked directly, not through
the relay, ready or not; a shared test replica may hold others' too; null when it does not answer); `replicas` is the
same for the replicas the proxy calls ready, null for the others. Replicas are keyed by the URL the proxy knows them
by (their relay), the one the provenance headers name. The last sample is taken after every fault has healed and
every replica in the fleet is ready again.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from lorafleet.ledger_format import LedgerFileError, ledger_path, read
from lorafleet.runs import run_of

SAMPLE_S = 1.0


class Observer:
    def __init__(self, root: Path, proxy_url: str, replicas: dict[str, str], runs: tuple[str, ...],
                 out: Path) -> None:
        """`replicas` maps the URL the proxy knows a replica by (its relay) to the replica's own URL: every slot,
        scaled down or not (one scaled down does not answer)."""
        self.root, self.proxy_url, self.replicas, self.runs, self.out = root, proxy_url, replicas, runs, out
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-observer", daemon=True)
        self._client = httpx.Client(timeout=2.0)

    def start(self) -> Observer:
        self._thread.start()
        return self

    def halt(self) -> None:
        self._halt.set()
        self._thread.join(timeout=30)

    def ready(self) -> set[str]:
        """The relay URLs the proxy calls ready now (none when the proxy does not answer)."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            fleet = self._client.get(self.proxy_url + "/fleet").json()
            return {replica["url"] for replica in fleet["replicas"] if replica["state"] == "ready"}
        return set()

    def sample(self) -> dict[str, Any]:
        ledger: dict[str, str] = {}
        with contextlib.suppress(LedgerFileError, OSError):
            state = read(ledger_path(self.root), self.root)
            ledger = {name: entry.fingerprint for name, entry in (state.adapters.items() if state else ())}
        ready = self.ready()
        held = {relay: self._served(own) for relay, own in self.replicas.items()}
        return {"time": round(time.time(), 3), "ledger": ledger,
                "replicas": {relay: names if relay in ready else None for relay, names in held.items()},
                "held": held}

    def record(self) -> dict[str, Any]:
        sample = self.sample()
        with open(self.out, "a", encoding="utf-8") as lines:
            lines.write(json.dumps(sample) + "\n")
        return sample

    def _served(self, url: str) -> list[str] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return sorted(card["id"] for card in self._client.get(url + "/v1/models").json()["data"]
                          if card.get("parent") and run_of(card["id"])[0] in self.runs)
        return None

    def _loop(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self.record()
