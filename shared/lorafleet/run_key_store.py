"""Per-run keys on a shared fleet: minting a key, its stored hash, the directory of hashes the proxy reads.

A run is otherwise only a URL prefix: anyone on the fleet network could load, unload, pause or read another
run's adapters by choosing its prefix. With RUN_KEYS_DIR set, each named run has a key; the directory holds
one file per run, named for the run, holding only `sha256:<hex>` of the key (a key is 256 random bits, so a
plain hash is as good as a slow one: there is nothing to guess). The key itself is printed once or written to
a file only its trainer reads. The same directory is a Compose bind mount or a Kubernetes Secret's volume
(each Secret key a file), which is why it is a directory of small files rather than one file to edit.

The command `lorafleet run-key NAME` (lorafleet_ops.commands.run_key) mints with `provision`; this module and the
command need only the standard library, so `make train RUN=b` can make a key on a host that has no lorafleet installed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from lorafleet.runs import DEFAULT_RUN, RunNameError, check_run_name

KEY_PREFIX = "lfr_"  # recognisable in a leaked log or a secret scanner's rules
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")


class RunKeyError(ValueError):
    """The run-keys directory or one of its files is not what `lorafleet run-key` writes."""


def mint() -> str:
    """A new run key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """What is stored for `key`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def matches(key: str, stored: str) -> bool:
    return hmac.compare_digest(digest(key), stored)


def read_keys(directory: Path) -> dict[str, str]:
    """{run: stored digest} of every run file in `directory`. Hidden entries (a Secret volume's `..data` links,
    editors' swap files) are skipped; anything else that is not a valid run's digest is an error naming it."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise RunKeyError(f"cannot read the run-keys directory {directory}: {exc.strerror or exc}") from None
    keys: dict[str, str] = {}
    for entry in entries:
        if entry.name.startswith(".") or entry.is_dir():
            continue
        try:
            run = check_run_name(entry.name)
        except RunNameError as exc:
            raise RunKeyError(f"{entry}: the file's name is not a run name ({exc})") from None
        if run == DEFAULT_RUN:
            raise RunKeyError(f"{entry}: the default run has no key (it is the fleet's own, without a prefix)")
        try:
            stored = entry.read_text().strip()
        except OSError as exc:
            raise RunKeyError(f"cannot read {entry}: {exc.strerror or exc}") from None
        if not DIGEST_PATTERN.fullmatch(stored):
            raise RunKeyError(f"{entry}: expected one line 'sha256:<64 hex digits>' as `lorafleet run-key` writes")
        keys[run] = stored
    return keys


def provision(directory: Path, run: str, *, rotate: bool = False, run_name: str | None = None) -> str:
    """Mint a key for `run`, store its digest in `directory` (created if missing) and return the key. An existing
    key is kept (RunKeyError) unless `rotate`: a second trainer must not lock the first one out by accident.

    `run_name`: the fleet's RUN_NAME, the default run's folder. A key by that name is refused: its holder would load
    from `runs/<RUN_NAME>/` as a named run, the folder of the keyless default run's trainer."""
    check_run_name(run)
    if run == DEFAULT_RUN:
        raise RunKeyError("the default run has no key (it is the fleet's own, without a prefix)")
    if run == run_name:
        raise RunKeyError(f"run {run!r} is the fleet's RUN_NAME, the default run's folder runs/{run}/: a key by that "
                          "name would open that folder to a named run; name the run otherwise (or set RUN_NAME)")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / run
    if path.exists() and not rotate:
        raise RunKeyError(f"run {run!r} already has a key ({path}); --rotate replaces it (its trainer then needs "
                          "the new one)")
    key = mint()
    # Written beside and renamed over: the proxy never reads half a file.
    partial = directory / f".{run}.partial"
    partial.write_text(digest(key) + "\n")
    os.replace(partial, path)
    return key


def write_private(path: Path, key: str) -> None:
    """The key in a file only its owner can read (the trainer's TRAINER_RUN_KEY_FILE)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")
    os.chmod(path, 0o600)


def read_key_file(path: str) -> str:
    """The run key in TRAINER_RUN_KEY_FILE ("" when unset): read from a file, never from the environment, which
    `docker inspect` and /proc show to anyone who can look at the container."""
    from lorafleet.settings import ConfigError

    if not path:
        return ""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"TRAINER_RUN_KEY_FILE: cannot read {path}: {exc.strerror or exc}") from None
    if not key or any(char.isspace() for char in key):
        raise ConfigError(f"TRAINER_RUN_KEY_FILE: {path} must hold one run key (as `lorafleet run-key` writes it)")
    return key
