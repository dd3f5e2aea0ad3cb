"""The proxy's adapter ledger on disk: one reader and one writer, shared by the proxy and the doctor.

`<ADAPTER_ROOT>/.fleet/proxy-ledger.json`, version 4 (adapters served from the proxy's content store):

    {"version": 4, "paused": null | "abort" | "wait" | "keep",
     "runs": {"b": {"max_staleness": 4, "weight": 1.0, "paused": null | "abort" | "wait" | "keep"}, ...},
     "adapters": [{"name": "b--trl-policy-v7", "run": "b", "path": "<store>/<hex>", "fingerprint": "sha256:<hex>",
                   "source": "/adapters/runs/b/.vllm_lora/trl-policy-v7",
                   "attested": {"vllm 0.31.0 torch.float32/torch.float32": {"weights": "sha256:<hex>",
                                                                            "slot": "sha256:<hex>"}}}, ...]}

Each entry maps a name to one content: `fingerprint` identifies it (see `fingerprint`) and `path` is its folder in the
proxy's content store (PROXY_CONTENT_STORE, default `<ADAPTER_ROOT>/.content`), named by the fingerprint's hex, which
is what the replicas load; `attested` (optional) holds the engine's digests of it per replica group, the first
replica's to attest; `source` is the folder it was copied from when it was published ("" when the ledger was
rebuilt from the replicas' lists). `runs` are the registered
runs (their slot reservation, fair-share weight and run-scoped pause, which the proxy holds itself); every adapter
entry names its run, and its fleet-unique name is the run's qualified name (`<run>--<name>`, see `lorafleet.runs`).
`adapters` is in load order. An entry whose `path` is not `<store>/<hex of its fingerprint>`, or whose `source` does
not lie in its run's folder (`runs/<run>/`, symlinks followed) as its load had to, is dropped when the file is read,
never loaded into a replica. `paused` is the fleet's pause state: a restarted proxy keeps a paused fleet paused.

Older versions are read and migrated by the proxy (it copies each entry's files into the store, see
lorafleet_proxy.ledger): their `path` is the run folder the replicas loaded, and becomes the entry's `source`.
Version 3 is version 4 without `source` and with run-folder paths; version 2 has no `runs` and only the default run's
adapters; version 1 (`{"version": 1, "adapters": [{"name", "path"}]}`) also has no fingerprints ("": unknown) and no
pause.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.adapters import (
    AdapterNameError,
    AdapterPathError,
    check_adapter_name,
    confine,
    content_dir,
    fleet_dir,
    run_dir,
)
from lorafleet.runs import DEFAULT_RUN, RunNameError, check_run_name, run_of, run_slots

LEDGER_FILE = "proxy-ledger.json"
LEDGER_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
PAUSE_MODES = ("abort", "wait", "keep")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_SUFFIX = ".safetensors"
CHUNK = 1 << 20
FINGERPRINT_PREFIX = "sha256:"


class LedgerFileError(ValueError):
    """The ledger file exists but cannot be used (unreadable, not JSON, unknown version, wrong shape)."""


@dataclass(frozen=True)
class Entry:
    """One adapter of the ledger: where replicas load it, its content, whose it is, where it was published from.

    `path` is a content-store folder, except in an entry read from a file older than version 4 (then it is the run
    folder the replicas loaded: the proxy migrates it)."""

    path: str
    fingerprint: str = ""
    run: str = DEFAULT_RUN
    source: str = ""
    # The engine's digests of this content, per replica group (vLLM version and dtype): (group, weights, slot
    # weights), the first attesting replica's (docs/concepts/provenance.md#attestation-what-the-engine-holds).
    attested: tuple[tuple[str, str, str], ...] = ()

    def reference(self, group: str) -> tuple[str, str] | None:
        """(weights, slot weights) attested for this content by `group`'s first replica ("": not seen yet)."""
        return next(((weights, slot) for known, weights, slot in self.attested if known == group), None)


@dataclass(frozen=True)
class RunRecord:
    """A registered run: the slots it reserves on every replica (max_staleness + 2), its fair-share weight
    and its run-scoped pause (held at the proxy; None = running)."""

    max_staleness: int
    weight: float = 1.0
    paused: str | None = None

    @property
    def slots(self) -> int:
        return run_slots(self.max_staleness)


@dataclass
class LedgerState:
    """The whole ledger: adapters in load order, the fleet's pause mode (None = running), registered runs."""

    adapters: dict[str, Entry] = field(default_factory=dict)
    paused: str | None = None
    dropped: list[str] = field(default_factory=list)  # entries of the file that failed validation, with why
    runs: dict[str, RunRecord] = field(default_factory=dict)

    def copy(self) -> LedgerState:
        return LedgerState(dict(self.adapters), self.paused, runs=dict(self.runs))

    def same_as(self, other: LedgerState) -> bool:
        return (list(self.adapters.items()) == list(other.adapters.items()) and self.paused == other.paused
                and self.runs == other.runs)


def ledger_path(adapter_root: Path) -> Path:
    return fleet_dir(adapter_root) / LEDGER_FILE


def adapter_files(names: list[str]) -> list[str]:
    """The names of a folder's listing that make up an adapter's content, in hashing order (config and weights)."""
    return sorted(name for name in names if name == CONFIG_FILE or name.endswith(WEIGHTS_SUFFIX))


class ContentHash:
    """The fingerprint's digest, fed file by file in `adapter_files` order: `fingerprint` and the proxy's content
    store (which hashes while it copies) compute the same value with it."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def start(self, name: str) -> None:
        self._digest.update(name.encode() + b"\0")

    def update(self, chunk: bytes) -> None:
        self._digest.update(chunk)

    def end(self) -> None:
        self._digest.update(b"\0")

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def folder_digest(directory: str | os.PathLike[str]) -> str:
    """The hex sha256 of the adapter's files in `directory` (`adapter_files`, names and bytes, in name order): the
    fingerprint's value, and the name of a content-store folder. Raises OSError when a file cannot be read."""
    digest = ContentHash()
    for name in adapter_files(os.listdir(directory)):
        digest.start(name)
        with open(Path(directory) / name, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        digest.end()
    return digest.hexdigest()


def fingerprint(adapter: str | os.PathLike[str]) -> str:
    """sha256 over the adapter's adapter_config.json and *.safetensors (`folder_digest`), prefixed "sha256:".

    Two loads of one name and path with different fingerprints are different weights (a trainer that
    crashed after publishing and republished). Returns "" when the directory or its config cannot be
    read.
    """
    try:
        if not os.path.lexists(Path(adapter) / CONFIG_FILE):
            return ""
        return f"{FINGERPRINT_PREFIX}{folder_digest(adapter)}"
    except OSError:
        return ""


def check_run_folder(path: str, run: str, adapter_root: Path) -> str:
    """`path` inside `adapter_root`, and inside `runs/<run>/` for a named run, read as written (`confine`: nothing
    resolved; the proxy's walk opens it without following symlinks); else AdapterPathError.

    The proxy confines a named run's loads to its own folder (lorafleet_proxy.runs.confinement); an entry that names
    another folder was written by something else, and loading it would serve another run's weights under this run's
    name. The default run's folders depend on the fleet's run keys, so only the root holds it here."""
    relative = confine(path, adapter_root)
    if run != DEFAULT_RUN and relative.parts[:2] != ("runs", run):
        raise AdapterPathError(f"path {path!r} of run {run!r} lies outside its folder {run_dir(adapter_root, run)}/")
    return str(Path(adapter_root) / relative)


def parse(text: str | bytes, adapter_root: Path, content_store: Path | None = None) -> LedgerState:
    """A ledger file's content -> state. Raises LedgerFileError when the file as a whole is unusable; single entries
    with a bad name, a path that is not their content's store folder (`content_store`, default
    `<adapter_root>/.content`; before version 4: a path outside `adapter_root` or outside their named run's folder) or
    a source outside their run's folder are dropped (listed in `dropped`)."""
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise LedgerFileError(f"not JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("version") not in READABLE_VERSIONS:
        version = payload.get("version") if isinstance(payload, dict) else None
        raise LedgerFileError(f"not a ledger of version {READABLE_VERSIONS} (version={version!r})")
    items = payload.get("adapters", [])
    paused = payload.get("paused") if payload["version"] >= 2 else None
    if not isinstance(items, list):
        raise LedgerFileError("'adapters' is not a list")
    _check_pause(paused, "'paused'")
    store = content_store or content_dir(adapter_root)
    state = LedgerState(paused=paused, runs=_parse_runs(payload.get("runs", {}) if payload["version"] >= 3 else {}))
    for item in items:
        try:
            if not isinstance(item, dict):
                raise AdapterNameError("entry is not an object")
            name = check_adapter_name(item.get("name"))
            digest = item.get("fingerprint", "")
            if not isinstance(digest, str):
                raise AdapterPathError(f"fingerprint {digest!r} is not a string")
            run = item.get("run", DEFAULT_RUN)
            if run != run_of(name)[0]:
                raise AdapterNameError(f"run {run!r} does not own the name {name!r}")
            if payload["version"] < LEDGER_VERSION:
                entry = Entry(check_run_folder(str(item.get("path", "")), run, adapter_root), digest, run)
            else:
                source = str(item.get("source", ""))
                entry = Entry(_store_path(item.get("path"), digest, store), digest, run,
                              source and check_run_folder(source, run, adapter_root), _attested(item))
        except (AdapterNameError, AdapterPathError) as exc:
            state.dropped.append(f"{item!r}: {exc}")
            continue
        state.adapters[name] = entry
    return state


def _attested(item: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """An entry's optional `attested` object ({group: {"weights", "slot"}}); anything else in it is dropped, as a
    missing reference is only attested again."""
    attested = item.get("attested", {})
    if not isinstance(attested, dict):
        return ()
    return tuple((group, str(value.get("weights", "")), str(value.get("slot", "")))
                 for group, value in attested.items() if isinstance(value, dict))


def _store_path(path: object, digest: str, store: Path) -> str:
    """`path` when it is the content store's folder of `digest`; else AdapterPathError."""
    expected = str(store / digest.removeprefix(FINGERPRINT_PREFIX))
    if not digest.startswith(FINGERPRINT_PREFIX) or path != expected:
        raise AdapterPathError(f"path {path!r} is not the content store's folder of fingerprint {digest!r} "
                               f"({expected})")
    return expected


def _check_pause(paused: object, where: str) -> None:
    if paused is not None and paused not in PAUSE_MODES:
        raise LedgerFileError(f"{where} is {paused!r}, not one of {PAUSE_MODES} or null")


def _parse_runs(runs: object) -> dict[str, RunRecord]:
    if not isinstance(runs, dict):
        raise LedgerFileError("'runs' is not an object")
    records = {}
    for run, record in runs.items():
        try:
            check_run_name(run)
        except RunNameError as exc:
            raise LedgerFileError(str(exc)) from None
        staleness = record.get("max_staleness") if isinstance(record, dict) else None
        weight = record.get("weight", 1.0) if isinstance(record, dict) else None
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise LedgerFileError(f"run {run!r}: 'max_staleness' {staleness!r} is not an integer >= 0")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not weight > 0:
            raise LedgerFileError(f"run {run!r}: 'weight' {weight!r} is not a number > 0")
        _check_pause(record.get("paused"), f"run {run!r}: 'paused'")
        records[run] = RunRecord(staleness, float(weight), record.get("paused"))
    return records


def read(path: Path, adapter_root: Path, content_store: Path | None = None) -> LedgerState | None:
    """The ledger at `path`, or None when there is no file. Raises LedgerFileError when it cannot be used."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerFileError(f"cannot read {path}: {exc}") from exc
    return parse(text, adapter_root, content_store)


def entries_json(state: LedgerState) -> list[dict[str, Any]]:
    """The adapter entries as the file (and the proxy's GET /fleet) write them (`attested` only once known: older
    readers see the file they know)."""
    return [{"name": name, "run": entry.run, "path": entry.path, "fingerprint": entry.fingerprint,
             "source": entry.source,
             **({"attested": {group: {"weights": weights, "slot": slot} for group, weights, slot in entry.attested}}
                if entry.attested else {})} for name, entry in state.adapters.items()]


def serialize(state: LedgerState) -> bytes:
    payload: dict[str, Any] = {
        "version": LEDGER_VERSION,
        "paused": state.paused,
        "runs": {run: {"max_staleness": record.max_staleness, "weight": record.weight, "paused": record.paused}
                 for run, record in state.runs.items()},
        "adapters": entries_json(state),
    }
    return json.dumps(payload, indent=1).encode()


def write(path: Path, state: LedgerState) -> None:
    """Durably replace the ledger: temporary file, fsync, rename, fsync of the directory.

    A crash leaves the old or the new file, never half of one, and an acknowledged write survives a
    power cut. Raises OSError (disk full, read-only volume): the caller must not acknowledge the change.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(serialize(state))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
