"""Adapter names and the adapter store layout, shared by trainer, replicas, proxy and doctor.

TRL publishes `trl-policy-v<N>` under `<output_dir>/.vllm_lora/`; lorafleet puts output_dir at
`<ADAPTER_ROOT>/runs/<run>`. Names are immutable versions: a name is never re-bound to other
weights (vLLM would serve stale prefix-cache blocks under it, vllm#42125).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

POLICY_PREFIX = "trl-policy"
POLICY_NAME_PATTERN = re.compile(r"^trl-policy-v([1-9][0-9]{0,8})$")
# Any adapter name the fleet accepts: short, no path separators, no whitespace, not starting with a dot.
ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FLEET_DIR_NAME = ".fleet"
CONTENT_DIR_NAME = ".content"  # the proxy's content store by default (lorafleet_proxy.content_store)
LORA_DIR_NAME = ".vllm_lora"
METRICS_FILE = "metrics.jsonl"  # one JSON line per logged step; status and the doctor read it


class AdapterPathError(ValueError):
    """A path points outside the adapter root (or is otherwise unusable)."""


class AdapterNameError(ValueError):
    """An adapter name does not match the accepted pattern."""


def policy_name(version: int) -> str:
    """`trl-policy-v<version>`, the name TRL gives the adapter of sync number `version`."""
    if version < 1:
        raise AdapterNameError(f"policy versions start at 1, got {version}")
    return f"{POLICY_PREFIX}-v{version}"


def policy_version(name: str) -> int | None:
    """The version of a `trl-policy-v<N>` name, or None when `name` is not a policy name."""
    match = POLICY_NAME_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def check_adapter_name(name: object) -> str:
    """Return `name` when it is an acceptable adapter name, else raise AdapterNameError."""
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name):
        raise AdapterNameError(
            f"invalid adapter name {name!r}: must match {ADAPTER_NAME_PATTERN.pattern} "
            "(letters, digits, '.', '_', '-'; at most 128 characters)"
        )
    return name


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> PurePosixPath:
    """`path` read as written, relative to `root`: the names a load opens one by one from the root, never resolved.

    Relative paths are taken from the root; an absolute one must begin with the root (as configured or resolved).
    `.` and `..` are read lexically, never through the filesystem: no symlink is consulted here, and the proxy's walk
    (lorafleet_proxy.content_store) opens each name with O_NOFOLLOW, so the names checked are the objects read. A
    path that climbs out of the root, is empty or holds a NUL byte is an AdapterPathError.
    """
    given = os.fspath(path)
    if not given or "\x00" in given:
        raise AdapterPathError(f"invalid adapter path {given!r}")
    parts = _lexical(PurePosixPath(given).parts if given.startswith("/") else ("/", *_under(root), *given.split("/")))
    for base in {_under(root), _under(os.path.realpath(root))}:
        if parts is not None and parts[:len(base)] == base:
            return PurePosixPath(*parts[len(base):])
    raise AdapterPathError(f"adapter path {given!r} lies outside the adapter root {os.fspath(root)} ('..' read as "
                           "written, symlinks never followed)")


def _under(root: str | os.PathLike[str]) -> tuple[str, ...]:
    """The names of an absolute `root` below `/`, `.` and `..` read lexically."""
    return _lexical(PurePosixPath(os.path.abspath(root)).parts) or ()


def _lexical(parts: tuple[str, ...]) -> tuple[str, ...] | None:
    """Absolute `parts` (`/` first) below `/` with `.`, empty names and `..` applied as written; None above `/`."""
    kept: list[str] = []
    for part in parts[1:]:
        if part in ("", "."):
            continue
        if part == "..":
            if not kept:
                return None
            kept.pop()
        else:
            kept.append(part)
    return tuple(kept)


def run_dir(root: Path, run: str) -> Path:
    """`<root>/runs/<run>`: the trainer's output_dir (checkpoints, metrics, final adapter)."""
    return root / "runs" / run


def metrics_path(root: Path, run: str) -> Path:
    """`<root>/runs/<run>/metrics.jsonl`: the trainer writes it, `lorafleet status`, the doctor and the demo read it."""
    return run_dir(root, run) / METRICS_FILE


def lora_dir(root: Path, run: str) -> Path:
    """`<root>/runs/<run>/.vllm_lora`: where TRL publishes versioned adapters."""
    return run_dir(root, run) / LORA_DIR_NAME


def adapter_dir(root: Path, run: str, name: str) -> Path:
    """`<root>/runs/<run>/.vllm_lora/<name>`."""
    return lora_dir(root, run) / check_adapter_name(name)


def fleet_dir(root: Path) -> Path:
    """`<root>/.fleet`: device claims and the proxy's adapter ledger (a small read-write volume)."""
    return root / FLEET_DIR_NAME


def content_dir(root: Path) -> Path:
    """`<root>/.content`: the proxy's content-addressed store (PROXY_CONTENT_STORE's default), read-only to replicas."""
    return root / CONTENT_DIR_NAME
