"""The fleet's adapter ledger: which adapters every ready replica must hold (in load order, each a content-store
folder with its fingerprint) and whether the fleet is paused.

It is the proxy's source of truth for catch-up: a replica that joins, comes back or restarted is
loaded with every ledger entry, in order, and paused like the fleet before it gets traffic. The file
format lives in `lorafleet.ledger_format` (the doctor reads the same file).

Changes go through `commit`: the new state is written durably first and only then becomes the
state in memory, so memory and disk never differ and a change whose write failed is not made.
A ledger file that exists but cannot be read is never taken for an empty ledger (that would unload
the whole fleet): the ledger stays `rebuilding` until the fleet rebuilds it from what the replicas
hold (`Fleet` does that at its first health round where replicas answer).

A restored ledger trusts no folder it cannot check: an entry whose store folder is missing, or whose content does not
hash to its name, is dropped with the reason logged (the replicas' lists are not evidence). An entry of an older file
(a run-folder path) is copied into the store now, through the store's one walk confined to the entry's run's folder
(the default run's: the adapter root, as a fleet without run keys), and kept only when the copy has the fingerprint it
was loaded with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from lorafleet.adapters import AdapterPathError, content_dir
from lorafleet.ledger_format import Entry, LedgerFileError, LedgerState, RunRecord, ledger_path, read, write
from lorafleet.runs import DEFAULT_RUN

from .content_store import ContentError, ContentStore
from .runs.confinement import confine_load

__all__ = ["Ledger", "LedgerWriteError", "ledger_path"]

log = logging.getLogger("lorafleet.proxy.ledger")


class LedgerWriteError(RuntimeError):
    """The ledger could not be persisted; the change it carried must not be acknowledged."""


class Ledger:
    def __init__(self, path: Path, adapter_root: Path, content: ContentStore | None = None) -> None:
        self.path = path
        self.adapter_root = adapter_root
        self.content = content or ContentStore(content_dir(adapter_root), adapter_root)
        self._state = LedgerState()
        self.rebuilding = False  # the file was unreadable: wait for the replicas before trusting any view
        self.unreadable_reason = ""
        self.observers: list[Callable[[LedgerState], None]] = []  # told every state that became the ledger

    def restore(self) -> None:
        """Read the persisted ledger. A missing file is an empty ledger; an unusable one means `rebuilding`."""
        self.content.sweep()  # copies a previous proxy left half done
        try:
            state = read(self.path, self.adapter_root, self.content.root)
        except LedgerFileError as exc:
            self.rebuilding, self.unreadable_reason = True, str(exc)
            log.error("ledger: %s is unusable (%s): it will be rebuilt from the adapters the replicas agree on; "
                      "nothing is unloaded meanwhile", self.path, exc)
            return
        if state is None:
            log.info("ledger: no file at %s, starting empty", self.path)
            return
        checked = self._checked(state)
        for reason in checked.dropped:
            log.warning("ledger: dropping entry %s", reason)
        self._state = checked.copy()
        if not checked.same_as(state) or state.dropped:
            try:
                write(self.path, self._state)
            except OSError as exc:  # memory holds the checked state; the next change writes it
                log.error("ledger: the checked ledger could not be written to %s: %s", self.path, exc)
        self._notify()
        log.info("ledger: restored %d adapter(s) from %s: %s paused=%s runs=%s", len(state.adapters), self.path,
                 list(state.adapters), state.paused, list(state.runs))

    def _checked(self, state: LedgerState) -> LedgerState:
        """`state` with every entry's store folder verified, older entries migrated into the store, the others
        dropped (with why, in `dropped`)."""
        checked = LedgerState(paused=state.paused, dropped=list(state.dropped), runs=dict(state.runs))
        for name, entry in state.adapters.items():
            legacy = self.content.digest_of(entry.path) is None  # a run-folder path: a file older than version 4
            why = "" if legacy else self.content.verify(entry.path)
            if legacy:
                try:
                    folders = None if entry.run == DEFAULT_RUN else [entry.run]
                    stored = self.content.ingest(confine_load(entry.path, self.adapter_root, folders, entry.run))
                except (ContentError, AdapterPathError) as exc:
                    why = f"its files cannot be copied into the content store: {exc}"
                else:
                    if entry.fingerprint and stored.fingerprint != entry.fingerprint:
                        why = (f"its files at {entry.path} changed after it was published (fingerprint at load "
                               f"{entry.fingerprint}, now {stored.fingerprint})")
                    entry = Entry(stored.path, stored.fingerprint, entry.run, entry.path)
                    log.info("ledger: migrated %s into the content store: %s", name, stored.path)
            if why:
                checked.dropped.append(f"{name} ({entry.path}): {why}")
            else:
                checked.adapters[name] = entry
        return checked

    def commit(self, state: LedgerState) -> None:
        """Persist `state` durably, then make it the ledger. Raises LedgerWriteError (memory unchanged)."""
        try:
            write(self.path, state)
        except OSError as exc:
            log.error("ledger: cannot persist to %s: %s", self.path, exc)
            raise LedgerWriteError(f"the fleet ledger {self.path} could not be written: {exc}") from exc
        self._state = state.copy()
        self.rebuilding = False
        self._notify()

    def _notify(self) -> None:
        for observer in self.observers:
            observer(self._state)

    def state(self) -> LedgerState:
        """A copy to change and `commit`."""
        return self._state.copy()

    def entries(self) -> dict[str, Entry]:
        """A copy, in load order."""
        return dict(self._state.adapters)

    def paths(self) -> dict[str, str]:
        return {name: entry.path for name, entry in self._state.adapters.items()}

    def get(self, name: str) -> Entry | None:
        return self._state.adapters.get(name)

    def runs(self) -> dict[str, RunRecord]:
        """The registered runs (a copy)."""
        return dict(self._state.runs)

    @property
    def paused(self) -> str | None:
        return self._state.paused

    async def collect_content(self) -> None:
        """Delete the content-store folders no entry names, once idle past the grace period (content_store; in a
        thread: the event loop goes on)."""
        referenced = [entry.path for entry in self._state.adapters.values()]
        await asyncio.to_thread(self.content.collect, referenced)

    def __len__(self) -> int:
        return len(self._state.adapters)
