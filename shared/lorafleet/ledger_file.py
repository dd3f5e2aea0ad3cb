"""The proxy's adapter ledger on disk: one reader and one writer, shared by the proxy and the doctor.

`<ADAPTER_ROOT>/.fleet/proxy-ledger.json`, version 2:

    {"version": 2, "paused": null | "abort" | "wait" | "keep",
     "adapters": [{"name": "trl-policy-v7", "path": "/adapters/runs/r/.vllm_lora/trl-policy-v7",
                   "fingerprint": "sha256:<hex>" | ""}, ...]}

`adapters` is in load order. `fingerprint` identifies the adapter's content (see `fingerprint`); ""
means unknown (the proxy could not read the directory, or the entry came from a version-1 file).
`paused` is the fleet's pause state: a restarted proxy keeps a paused fleet paused.

Version 1 (`{"version": 1, "adapters": [{"name", "path"}]}`) is read as: the same adapters with
unknown fingerprints, and the fleet not paused (version 1 never recorded a pause). It is rewritten
as version 2 at the next change.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.adapters import AdapterNameError, AdapterPathError, check_adapter_name, confine, fleet_dir

LEDGER_FILE = "proxy-ledger.json"
LEDGER_VERSION = 2
READABLE_VERSIONS = (1, 2)
PAUSE_MODES = ("abort", "wait", "keep")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_SUFFIX = ".safetensors"
CHUNK = 1 << 20


class LedgerFileError(ValueError):
    """The ledger file exists but cannot be used (unreadable, not JSON, unknown version, wrong shape)."""


@dataclass(frozen=True)
class Entry:
    """One adapter of the ledger: where it is and what it contained when the fleet loaded it."""

    path: str
    fingerprint: str = ""


@dataclass
class LedgerState:
    """The whole ledger: adapters in load order and the fleet's pause mode (None = running)."""

    adapters: dict[str, Entry] = field(default_factory=dict)
    paused: str | None = None
    dropped: list[str] = field(default_factory=list)  # entries of the file that failed validation, with why

    def copy(self) -> LedgerState:
        return LedgerState(dict(self.adapters), self.paused)

    def same_as(self, other: LedgerState) -> bool:
        return list(self.adapters.items()) == list(other.adapters.items()) and self.paused == other.paused


def ledger_path(adapter_root: Path) -> Path:
    return fleet_dir(adapter_root) / LEDGER_FILE


def fingerprint(adapter: str | os.PathLike[str]) -> str:
    """sha256 over the adapter's adapter_config.json and *.safetensors (names and bytes, in name order).

    Two loads of one name and path with different fingerprints are different weights (a trainer that
    crashed after publishing and republished). Returns "" when the directory or its config cannot be
    read: the proxy may not see the adapter volume (remote replicas), and then compares paths only.
    """
    directory = Path(adapter)
    try:
        names = sorted(p.name for p in directory.iterdir() if p.name == CONFIG_FILE or p.name.endswith(WEIGHTS_SUFFIX))
        if CONFIG_FILE not in names:
            return ""
        digest = hashlib.sha256()
        for name in names:
            digest.update(name.encode() + b"\0")
            with open(directory / name, "rb") as handle:
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
            digest.update(b"\0")
    except OSError:
        return ""
    return f"sha256:{digest.hexdigest()}"


def parse(text: str | bytes, adapter_root: Path) -> LedgerState:
    """A ledger file's content -> state. Raises LedgerFileError when the file as a whole is unusable;
    single entries with a bad name or a path outside `adapter_root` are dropped (listed in `dropped`)."""
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
    if paused is not None and paused not in PAUSE_MODES:
        raise LedgerFileError(f"'paused' is {paused!r}, not one of {PAUSE_MODES} or null")
    state = LedgerState(paused=paused)
    for item in items:
        try:
            if not isinstance(item, dict):
                raise AdapterNameError("entry is not an object")
            name = check_adapter_name(item.get("name"))
            path = str(confine(str(item.get("path", "")), adapter_root))
            digest = item.get("fingerprint", "")
            if not isinstance(digest, str):
                raise AdapterPathError(f"fingerprint {digest!r} is not a string")
        except (AdapterNameError, AdapterPathError) as exc:
            state.dropped.append(f"{item!r}: {exc}")
            continue
        state.adapters[name] = Entry(path, digest)
    return state


def read(path: Path, adapter_root: Path) -> LedgerState | None:
    """The ledger at `path`, or None when there is no file. Raises LedgerFileError when it cannot be used."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerFileError(f"cannot read {path}: {exc}") from exc
    return parse(text, adapter_root)


def serialize(state: LedgerState) -> bytes:
    payload: dict[str, Any] = {
        "version": LEDGER_VERSION,
        "paused": state.paused,
        "adapters": [{"name": name, "path": entry.path, "fingerprint": entry.fingerprint}
                     for name, entry in state.adapters.items()],
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
