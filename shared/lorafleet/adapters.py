"""Adapter names and the adapter store layout, shared by trainer, replicas, proxy and doctor.

TRL publishes `trl-policy-v<N>` under `<output_dir>/.vllm_lora/`; lorafleet puts output_dir at
`<ADAPTER_ROOT>/runs/<run>`. Names are immutable versions: a name is never re-bound to other
weights (vLLM would serve stale prefix-cache blocks under it, vllm#42125).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """Resolve `path` (symlinks and `..` included) and return it if it lies inside `root`.

    Relative paths are taken relative to the root. Anything resolving outside the root is an
    AdapterPathError: a runtime-LoRA load would otherwise read any directory the replica can see.
    """
    if isinstance(path, str) and (not path or "\x00" in path):
        raise AdapterPathError(f"invalid adapter path {path!r}")
    real_root = Path(root).resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = real_root / candidate
    resolved = candidate.resolve()
    if resolved != real_root and real_root not in resolved.parents:
        raise AdapterPathError(
            f"adapter path {os.fspath(path)!r} resolves to {resolved}, outside the adapter root {real_root}"
        )
    return resolved


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
