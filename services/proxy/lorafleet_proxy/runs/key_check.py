"""Per-run keys: a named run's routes on the fleet port need that run's own Bearer key (RUN_KEYS_DIR).

Checked before anything else happens to the request (no lease renewed, no run registered, no fair-share turn), so
a refused request changes nothing on the fleet. 401 without a key, with a key of no run, or for a run that has no
key; 403 with another run's key. The default run (no prefix) is the fleet's own and needs none, as before; on the
public port the operator's key (checked by `BearerAuth`) already admits every run.

The directory is read at start (a bad one stops the proxy, naming RUN_KEYS_DIR) and again at most every
RELOAD_S while requests come, so `lorafleet run-key NAME` takes effect without a restart; a directory that turns
bad later keeps the last good keys and logs why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lorafleet.run_key_store import RunKeyError, digest, read_keys
from lorafleet.settings import ConfigError
from starlette.types import Scope

from ..auth import on_public_port

log = logging.getLogger("lorafleet.proxy.runs")

RELOAD_S = 1.0
BEARER = b"bearer "


class RunKeyRefused(Exception):
    """A named run's request without its key: the status and vLLM-style error the front answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = "Unauthorized" if status == 401 else "Forbidden"


class RunKeys:
    """The runs' stored key digests, and the check of a request against them."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory) if directory else None
        self._runs: dict[str, str] = {}  # run -> digest
        self._owners: dict[str, str] = {}  # digest -> run
        self._loaded_at = 0.0
        self._problem = ""
        if self.directory is not None:
            try:
                self._take(read_keys(self.directory))
            except RunKeyError as exc:
                raise ConfigError(f"RUN_KEYS_DIR: {exc}") from None
            log.info("run keys on dir=%s runs=%d", self.directory, len(self._runs))

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def runs(self) -> list[str]:
        return sorted(self._runs)

    def _take(self, keys: dict[str, str]) -> None:
        self._runs, self._owners = keys, {stored: run for run, stored in keys.items()}
        self._loaded_at = time.monotonic()

    def _refresh(self) -> None:
        if self.directory is None or time.monotonic() - self._loaded_at < RELOAD_S:
            return
        try:
            keys = read_keys(self.directory)
        except RunKeyError as exc:
            self._loaded_at = time.monotonic()
            if str(exc) != self._problem:
                log.error("run keys unreadable, keeping the last good ones (runs=%s): %s", self.runs(), exc)
                self._problem = str(exc)
            return
        if keys != self._runs:
            log.info("run keys changed runs=%s", sorted(keys))
        self._problem = ""
        self._take(keys)

    def keyed(self) -> frozenset[str] | None:
        """The runs that have keys; None when the fleet has no run keys."""
        if self.directory is None:
            return None
        self._refresh()
        return frozenset(self._runs)

    def owner(self, scope: Scope) -> str | None:
        """The run whose key the request presents on the fleet port (None: no run keys, no key, or no run's)."""
        if self.directory is None or on_public_port(scope):
            return None
        self._refresh()
        given = _bearer(scope)
        return self._owners.get(digest(given)) if given else None

    def check(self, scope: Scope, run: str) -> None:
        """Raise RunKeyRefused unless the request may act as `run` (a named run, on the fleet port)."""
        if self.directory is None or on_public_port(scope):
            return
        self._refresh()
        given = _bearer(scope)
        if not given:
            raise RunKeyRefused(401, f"run {run!r} needs its run key: 'Authorization: Bearer <key>' "
                                "(this fleet has run keys, RUN_KEYS_DIR)")
        owner = self._owners.get(digest(given))
        if owner == run:
            return
        if owner is not None:
            raise RunKeyRefused(403, f"this key is another run's, not run {run!r}'s")
        if run not in self._runs:
            raise RunKeyRefused(401, f"run {run!r} has no key on this fleet: `lorafleet run-key {run}` makes one")
        raise RunKeyRefused(401, f"invalid run key for run {run!r}")


def _bearer(scope: Scope) -> str:
    """The request's Bearer key ("" when it has none)."""
    given = dict(scope["headers"]).get(b"authorization", b"")
    if given[:len(BEARER)].lower() != BEARER:
        return ""
    return given[len(BEARER):].strip().decode("latin-1")
