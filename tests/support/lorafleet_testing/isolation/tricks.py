"""What a hostile tenant can do with write access to its own run folder only: one trick per attempt, set up before
its load and, for the races, a thread that keeps changing the folder while the proxy reads it.

Every trick starts from a fresh copy of the adversary's own adapter (`Scene.fresh`), so any byte a load stores that is
not a victim's is the adversary's own. The tricks: symlink swaps at every component (version folder, `.vllm_lora`,
the run folder, one file), rename swaps, a file replaced, growing or shrinking while it is copied, hard links to a
victim's file, FIFOs, device files (root only: `skipped` elsewhere), sockets, sparse huge files, zero-byte weights, a
config naming a victim's files, `..`, absolute paths, paths into `.content/` and `.fleet/`, a victim's version and
adapter names, unicode and percent-encoded names, and one the tenant cannot do, a store folder left torn under the name
its next load hashes to (`TRICKS`; loads racing another tenant's loads of the same content
are the harness's, which drives two tenants at once).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.adapters import content_dir, fleet_dir, lora_dir, run_dir
from lorafleet.ledger_format import FINGERPRINT_PREFIX, fingerprint
from lorafleet.runs import qualify

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
VICTIM_VERSION = "trl-policy-v1"  # each victim's published version; the adversary names its own folders like it
Racer = Callable[[threading.Event], None]
RACES = ("swap-version", "swap-version-relative", "rename-swap", "swap-file", "swap-lora-dir", "swap-run-dir",
         "replace-file", "grow-file", "shrink-file")
STATIC = ("symlink-version", "symlink-file", "hardlink", "fifo", "device", "socket", "sparse-huge", "zero-bytes",
          "config-names-other", "dotdot", "absolute", "proxy-folders", "victim-version-name", "victim-adapter-name",
          "unicode-names", "store-leftover", "own")
TRICKS = RACES + STATIC


class Skipped(Exception):
    """This machine cannot set the trick up (a device file needs root)."""


@dataclass
class Scene:
    """The adapter root as the adversary sees it: its own run folder, its adapter, the victims' published folders."""

    root: Path
    adversary: str
    template: Path  # the adversary's own adapter, in its own run folder
    victims: dict[str, Path]  # run -> its published version folder (read only to the adversary)
    max_bytes: int  # the proxy's PROXY_ADAPTER_MAX_MB in bytes
    store: Path  # the proxy's content store: only `store-leftover` writes it, as a torn folder a power cut left

    @property
    def own(self) -> Path:
        return lora_dir(self.root, self.adversary)

    def fresh(self, relative: str) -> Path:
        """A fresh copy of the adversary's adapter at `own/relative` (what was there goes)."""
        target = self.own / relative
        clear(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.template, target)
        return target


@dataclass
class Plan:
    """One attempt: the lora_name and lora_path the adversary sends, and the thread that races the load (if any)."""

    name: str
    path: str
    racer: Racer | None = None
    undo: list[Callable[[], None]] = field(default_factory=list)


def clear(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _pause(rng: random.Random) -> None:
    time.sleep(rng.uniform(0, 0.004))


def _flip(path: Path, target: Path, rng: random.Random) -> Racer:
    """Move `path` aside, put a symlink to `target` in its place, a moment, and back; until stopped."""
    aside = path.with_name(path.name + ".aside")

    def race(stop: threading.Event) -> None:
        while not stop.is_set():
            os.rename(path, aside)
            os.symlink(target, path)
            _pause(rng)
            os.unlink(path)
            os.rename(aside, path)
            _pause(rng)

    return race


def _exchange(path: Path, target: Path, rng: random.Random) -> Racer:
    """A rename swap: a symlink made beforehand is renamed over the place the folder was moved from."""
    aside, ready = path.with_name(path.name + ".aside"), path.with_name(path.name + ".ready")

    def race(stop: threading.Event) -> None:
        while not stop.is_set():
            os.symlink(target, ready)
            os.rename(path, aside)
            os.rename(ready, path)
            _pause(rng)
            os.rename(path, ready)
            os.rename(aside, path)
            os.unlink(ready)
            _pause(rng)

    return race


def _rewrite(weights: Path, rng: random.Random, how: str) -> Racer:
    """The weights file replaced by rename, grown or shrunk, again and again, while the load copies it."""
    original = weights.read_bytes()

    def race(stop: threading.Event) -> None:
        while not stop.is_set():
            if how == "replace":
                spare = weights.with_name(".spare")
                spare.write_bytes(original[::-1])
                os.rename(spare, weights)
            elif how == "grow":
                with open(weights, "ab") as handle:
                    handle.write(b"\0" * rng.randint(1, 4096))
            else:
                os.truncate(weights, rng.randint(1, max(len(original) - 1, 1)))
            _pause(rng)
            weights.write_bytes(original)

    return race


def _socket_at(path: Path) -> None:
    """A listening Unix socket at `path` (bound under a short name, then renamed: socket paths are short)."""
    short = Path(tempfile.mkdtemp(prefix="s")) / "s"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(short))
    server.close()
    os.rename(short, path)
    short.parent.rmdir()


def plan(trick: str, scene: Scene, rng: random.Random, number: int) -> Plan:
    """Set up `trick` for attempt `number`; raises Skipped where this machine cannot."""
    victim = rng.choice(sorted(scene.victims))
    theirs = scene.victims[victim]
    name = f"m{number}"
    mine = scene.fresh(name)
    path = str(mine.relative_to(scene.root)) if rng.random() < 0.5 else str(mine)
    weights = mine / WEIGHTS
    if trick == "swap-version":
        return Plan(name, path, _flip(mine, theirs, rng))
    if trick == "swap-version-relative":
        return Plan(name, path, _flip(mine, Path(os.path.relpath(theirs, mine.parent)), rng))
    if trick == "rename-swap":
        return Plan(name, path, _exchange(mine, theirs, rng))
    if trick == "swap-file":
        return Plan(name, path, _flip(weights, theirs / WEIGHTS, rng))
    if trick in ("swap-lora-dir", "swap-run-dir"):
        same = scene.fresh(VICTIM_VERSION)  # the victim's version name, so the swapped path reaches its files
        folder = scene.own if trick == "swap-lora-dir" else run_dir(scene.root, scene.adversary)
        target = theirs.parent if trick == "swap-lora-dir" else run_dir(scene.root, victim)
        return Plan(name, str(same), _flip(folder, target, rng))
    if trick in ("replace-file", "grow-file", "shrink-file"):
        return Plan(name, path, _rewrite(weights, rng, trick.removesuffix("-file")))
    if trick == "victim-adapter-name":
        return Plan(qualify(victim, VICTIM_VERSION), path)
    return Plan(name, _static(trick, scene, mine, theirs, rng, path))


def _static(trick: str, scene: Scene, mine: Path, theirs: Path, rng: random.Random, path: str) -> str:
    """Set up a trick that needs no race; the lora_path to send."""
    weights = mine / WEIGHTS
    if trick == "symlink-version":
        clear(mine)
        mine.symlink_to(theirs if rng.random() < 0.5 else Path(os.path.relpath(theirs, mine.parent)))
    elif trick == "symlink-file":
        weights.unlink()
        weights.symlink_to(theirs / WEIGHTS)
    elif trick == "hardlink":
        weights.unlink()
        os.link(theirs / WEIGHTS, weights)
    elif trick == "fifo":
        weights.unlink()
        os.mkfifo(weights)
    elif trick == "device":
        weights.unlink()
        try:
            os.mknod(weights, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            raise Skipped("mknod needs root") from None
    elif trick == "socket":
        weights.unlink()
        _socket_at(weights)
    elif trick == "sparse-huge":
        os.truncate(weights, scene.max_bytes + rng.randint(1, 1 << 30))
    elif trick == "zero-bytes":
        os.truncate(weights, 0)
    elif trick == "config-names-other":
        config = json.loads((mine / CONFIG).read_text())
        config.update(base_model_name_or_path=str(theirs), weights=str(theirs / WEIGHTS), modules_to_save=None)
        (mine / CONFIG).write_text(json.dumps(config))
    elif trick == "dotdot":
        return f"{path}/../../../{theirs.relative_to(theirs.parents[2])}"
    elif trick == "absolute":
        return str(theirs)
    elif trick == "proxy-folders":
        return rng.choice([str(content_dir(scene.root)), str(fleet_dir(scene.root)), ".content/../.fleet",
                           f"{mine}/../../../../.content"])
    elif trick == "victim-version-name":
        return str(scene.fresh(VICTIM_VERSION).relative_to(scene.root))
    elif trick == "store-leftover":  # not the tenant's doing: a store folder left torn, named as its next load hashes
        data = bytearray(weights.read_bytes())
        data[-4:] = (int.from_bytes(data[-4:], "little") ^ rng.getrandbits(32) | 1).to_bytes(4, "little")
        weights.write_bytes(bytes(data))  # the last weight's bits: still a valid adapter, a content never seen
        leftover = scene.store / fingerprint(mine).removeprefix(FINGERPRINT_PREFIX)
        if leftover.exists():  # the running proxy wrote and checked it: overwriting it is no leftover of a crash
            raise Skipped("that content's store folder is the running proxy's own")
        shutil.copytree(theirs, leftover)
    elif trick == "unicode-names":
        odd = rng.choice(["%2e%2e/%2e%2e/alice/.vllm_lora/trl-policy-v1", "trl%2Dpolicy-v1", "v\u00e9", "ve\u0301",
                          "v\u2024\u2024", "trl-policy-v1\u200b", "..%2F..%2Fbob"])
        return str(scene.fresh(odd))
    return path
