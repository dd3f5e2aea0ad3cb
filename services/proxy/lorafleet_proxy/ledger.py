"""The fleet's adapter ledger: which adapters every ready replica must hold, in load order.

It is the proxy's source of truth for catch-up: a replica that joins, comes back or restarted is
loaded with every ledger entry, in order, before it gets traffic. It is persisted atomically to
`<ADAPTER_ROOT>/.fleet/proxy-ledger.json` = `{"version": 1, "adapters": [{"name", "path"}, ...]}`
so that a restarted proxy restores the fleet's state.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from lorafleet.adapters import AdapterNameError, AdapterPathError, check_adapter_name, confine, fleet_dir

log = logging.getLogger("lorafleet.proxy.ledger")

LEDGER_FILE = "proxy-ledger.json"
LEDGER_VERSION = 1


def ledger_path(adapter_root: Path) -> Path:
    return fleet_dir(adapter_root) / LEDGER_FILE


class Ledger:
    """Adapter name -> path in load order, saved after every change."""

    def __init__(self, path: Path, adapter_root: Path) -> None:
        self.path = path
        self.adapter_root = adapter_root
        self._entries: dict[str, str] = {}

    def restore(self) -> None:
        """Read the persisted ledger; entries that are no longer valid are dropped with a warning."""
        try:
            payload = json.loads(self.path.read_text())
        except FileNotFoundError:
            log.info("ledger: no file at %s, starting empty", self.path)
            return
        except (OSError, ValueError) as exc:
            log.error("ledger: unreadable %s (%s), starting empty", self.path, exc)
            return
        if not isinstance(payload, dict) or payload.get("version") != LEDGER_VERSION:
            log.error("ledger: %s is not a version-%d ledger, starting empty", self.path, LEDGER_VERSION)
            return
        for item in payload.get("adapters", []):
            try:
                name = check_adapter_name(item.get("name"))
                path = str(confine(str(item.get("path", "")), self.adapter_root))
            except (AdapterNameError, AdapterPathError, AttributeError) as exc:
                log.warning("ledger: dropping entry %r: %s", item, exc)
                continue
            self._entries[name] = path
        log.info("ledger: restored %d adapter(s) from %s: %s", len(self._entries), self.path, list(self._entries))

    def save(self) -> None:
        """Write atomically (temporary file + rename): a crash leaves the old or the new ledger, never half."""
        payload = {"version": LEDGER_VERSION,
                   "adapters": [{"name": name, "path": path} for name, path in self._entries.items()]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(payload, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("ledger: cannot persist to %s: %s (a restarted proxy would forget adapters)", self.path, exc)

    def entries(self) -> dict[str, str]:
        """A copy, in load order."""
        return dict(self._entries)

    def get(self, name: str) -> str | None:
        return self._entries.get(name)

    def put(self, name: str, path: str) -> None:
        self._entries.pop(name, None)
        self._entries[name] = path
        self.save()

    def remove(self, name: str) -> bool:
        if self._entries.pop(name, None) is None:
            return False
        self.save()
        return True

    def __len__(self) -> int:
        return len(self._entries)
