"""Published adapters the proxy can read: it copies each one into its content store as a user of its own.

safetensors writes its file 0600 whatever the umask (a private temporary file renamed into place). In Compose the
trainer runs as root and the proxy as uid 10001, so the proxy could not read the weights it has to copy, and every
publish was refused ("cannot be opened as a plain file: Permission denied"). Before each load request the trainer
makes the adapter's files readable by every user: within the fleet they are not secret (every replica serves them),
and other runs' trainers still cannot reach them (each mounts only its own run folder).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from lorafleet_trainer import trl_seam

READABLE = 0o444


def fleet_readable(folder: str | os.PathLike[str]) -> None:
    """Add read permission for everyone to the regular files directly in `folder` (symlinks are left alone). A folder
    that is not there is left to the load itself to report (the proxy's "No adapter found")."""
    try:
        listing = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    with listing as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode
                if mode & READABLE != READABLE:
                    os.chmod(entry.path, (mode | READABLE) & 0o7777, follow_symlinks=False)


def readable_before_load() -> None:
    """Make TRL's VLLMClient.load_lora_adapter call `fleet_readable` on the adapter's folder first (once)."""
    if not getattr(trl_seam.adapter_load(), "makes_readable", False):
        trl_seam.wrap_adapter_load(readable_first)


def readable_first(load: Callable[..., None]) -> Callable[..., None]:
    """`load` (TRL's VLLMClient.load_lora_adapter) calling `fleet_readable` on the adapter's folder first."""

    @functools.wraps(load)
    def load_readable(self: Any, lora_name: str, lora_path: str, *args: Any, **kwargs: Any) -> None:
        fleet_readable(lora_path)
        return load(self, lora_name, lora_path, *args, **kwargs)

    load_readable.makes_readable = True  # type: ignore[attr-defined]
    return load_readable
