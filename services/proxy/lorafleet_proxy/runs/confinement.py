"""Which folders under ADAPTER_ROOT a load may read: a run serves only weights from its own folder.

A run's key separates runs at the proxy's routes; without this rule a run could still load any directory under the
adapter root under its own name (another run's published adapters or checkpoints) and read them out by sampling.

- A named run `r` (under /runs/r/) loads only from `ADAPTER_ROOT/runs/r/`, on every fleet.
- The default run (no prefix) loads from anywhere under the root while the fleet has no run keys: without them any
  client of the fleet port may speak as any run, so there is nothing to separate. With run keys (RUN_KEYS_DIR) it
  loads from `runs/<RUN_NAME>/` (its trainer's folder), and a request that presents a run's key also from that run's
  folder (a named run's trainer runs the doctor's fleet-wide probe as the default run, with its key). A RUN_NAME
  that is a keyed run's name gives the keyless default run no folder at all.

The path is read as written (`lorafleet.adapters.confine`: `..` lexically, nothing resolved) and the rule is a
comparison of names: `runs/<run>/...`. It holds for the bytes read because the proxy's one walk
(content_store.py) opens exactly these names from the adapter root, each with O_NOFOLLOW: a symlink at any
component (a run folder that is a symlink to another run's, a version folder swapped for one) opens nothing.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path, PurePosixPath

from lorafleet.adapters import AdapterPathError, confine, run_dir
from lorafleet.runs import DEFAULT_RUN


class OutsideRunFolder(AdapterPathError):
    """The path resolves inside the adapter root but outside every folder the run may load from."""


def load_folders(run: str, run_name: str, keyed: Collection[str] | None, presented: str | None) -> list[str] | None:
    """The folders under `runs/` a load by `run` may read; None: anywhere under the root.

    `run_name`: the default run's folder (RUN_NAME); `keyed`: the runs with keys (None: the fleet has no run keys);
    `presented`: the run whose valid key the request carries, if any."""
    if run != DEFAULT_RUN:
        return [run]
    if keyed is None:
        return None
    own = [] if run_name in keyed else [run_name]
    return own + ([presented] if presented and presented not in own else [])


def confine_load(path: str, root: str | os.PathLike[str], folders: Sequence[str] | None, who: str) -> PurePosixPath:
    """`path` relative to `root` as the walk will open it, when it names one of `folders` under `runs/` (None:
    anywhere under `root`).

    Raises AdapterPathError outside the root, OutsideRunFolder outside the folders; `who` names the run in the
    message."""
    relative = confine(path, root)
    if folders is None or (relative.parts[:1] == ("runs",) and relative.parts[1:2] in [(f,) for f in folders]):
        return relative
    bases = [run_dir(Path(root), folder) for folder in folders]
    allowed = " or ".join(f"{base}/" for base in bases) or "none on this fleet (RUN_NAME is a keyed run's name)"
    raise OutsideRunFolder(
        f"lora_path {path!r} is outside the folder of {who} ({allowed}), read as written ('..' applied, symlinks "
        "never followed): a run loads adapters only from its own folder ADAPTER_ROOT/runs/<run>/, never another "
        "run's adapters or checkpoints")
