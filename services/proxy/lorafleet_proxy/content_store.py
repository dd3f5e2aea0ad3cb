"""The content store: what replicas load, written only by the proxy and named by its content.

A trainer writes its own run folder, so between the proxy's check of a load's path and a replica's read of it, the
trainer could swap a directory of the path for a symlink into another run's files. The proxy therefore never sends a
replica a path a trainer can change: at load it copies the adapter's files into `<store>/<hex>/` (hex: the sha256 of
`lorafleet.ledger_format.fingerprint`) and the replicas load that folder, which only the proxy writes.

One walk decides and reads (`ingest`), and it is the only way into the store (a load of any run, keyed or not, the
default run, a restored ledger's migration): it takes the path as written relative to ADAPTER_ROOT (never resolved:
`lorafleet.adapters.confine`), opens the root once, then each name with openat(dir_fd, name, O_NOFOLLOW|O_DIRECTORY)
(fstat: a folder, and not the store or `.fleet/`), lists the last folder from its descriptor, and opens each file
relative to it with O_NOFOLLOW|O_NONBLOCK (a FIFO, device or socket never blocks the open). A file must be regular,
have one link (a hard link could name another run's file), hold at least one byte and stay within
PROXY_ADAPTER_MAX_MB; it is read from its descriptor while hashed, and fstat again after the copy: a size, mtime or
length read that differs means the file changed while it was copied, and the load is refused. So the decision "a
plain folder of plain files inside the run's own folder" is made on the objects read, with no second resolution of
any path: a symlink planted anywhere at any moment fails the walk, and a folder swapped after an open changes nothing
of what was read. The files go into a temporary folder of the store (a reflink where the filesystem offers one, else
a copy hashed on the way), are hashed again as written, and the folder is renamed to its hash: a store folder is
complete or absent while the machine runs, and its name is its content. A folder of that name that already exists is
reused only once it hashed to its name (once per proxy start). Nothing is fsynced: a power cut may leave a folder
torn, and that hash check finds it (a restored ledger drops the entry, saying why; a new load replaces the folder),
and a publish does not wait on the disk four times (`make bench-store-cost`).

Garbage collection (`collect`): a folder that no ledger entry names, no load in flight pins and that was last
ingested or referenced more than the grace period ago is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lorafleet.adapters import AdapterPathError, confine, fleet_dir
from lorafleet.ledger_format import (
    CHUNK,
    CONFIG_FILE,
    FINGERPRINT_PREFIX,
    WEIGHTS_SUFFIX,
    ContentHash,
    adapter_files,
    folder_digest,
)
from lorafleet.logs import log_event
from lorafleet.safetensors_header import header_problem

__all__ = ["ContentError", "ContentStore", "NoAdapter", "Stored"]

log = logging.getLogger("lorafleet.proxy.content")

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), share the source's extents (btrfs, xfs, ...)
HEX_NAME = re.compile(r"^[0-9a-f]{64}$")
TEMP_PREFIX = ".tmp-"
FOLDER_MODE, FILE_MODE = 0o755, 0o444  # replicas read; nobody writes a published file again
NOFOLLOW = os.O_NOFOLLOW  # in every open of the walk (the isolation harness proves a walk without it is caught)
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


class ContentError(ValueError):
    """The adapter cannot be taken into the store as checked (a symlink, not a regular file, unreadable)."""


class NoAdapter(ContentError):
    """The folder has no adapter_config.json (yet): the trainer's files may not have reached this volume."""


@dataclass(frozen=True)
class Stored:
    """One content of the store: the folder replicas load and its fingerprint (`sha256:<hex>`, hex = folder name)."""

    path: str
    fingerprint: str
    source: str = ""  # the folder it was copied from, ADAPTER_ROOT/<the path as written>


class ContentStore:
    """`<root>/<hex>/` folders copied from adapter folders under `adapter_root`; see the module docstring."""

    def __init__(self, root: Path, adapter_root: Path, grace_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = 4096 << 20) -> None:
        self.root = root
        self.adapter_root = adapter_root
        self.max_bytes = max_bytes  # PROXY_ADAPTER_MAX_MB: one adapter's files together
        self.grace_s = grace_s
        self.clock = clock
        # Called with a stage name ("checked": nothing opened yet; "opened": the folder's descriptor is open, no file
        # read; "copied": the copy is hashed, not yet renamed; "stored": in the store, the broadcast follows): the one
        # injection point the race tests drive.
        self.stage: Callable[[str], None] = lambda stage: None
        self._lock = threading.Lock()  # ingest threads and the collector
        self._verified: set[str] = set()  # hex names hashed since this start
        self._since: dict[str, float] = {}  # hex -> last ingested or referenced (clock)
        self._pins: Counter[str] = Counter()  # hex -> loads in flight

    # --- names ------------------------------------------------------------------------------------
    def path_of(self, digest: str) -> str:
        return str(self.root / digest)

    def digest_of(self, path: str) -> str | None:
        """The hex name of a store folder path, or None when `path` is not `<root>/<hex>`."""
        candidate = Path(path)
        if candidate.parent != self.root or not HEX_NAME.fullmatch(candidate.name):
            return None
        return candidate.name

    # --- ingest -----------------------------------------------------------------------------------
    def ingest(self, path: str | os.PathLike[str]) -> Stored:
        """Copy the adapter at `path` (as written, relative to ADAPTER_ROOT or absolute under it: the route confined
        it to the run's folder) into the store through the walk (module docstring).

        Blocking: the proxy runs it in a thread. Raises NoAdapter, ContentError."""
        try:
            relative = confine(path, self.adapter_root)
        except AdapterPathError as exc:
            raise ContentError(str(exc)) from None
        source = str(self.adapter_root / relative)
        self.root.mkdir(parents=True, exist_ok=True)
        self.stage("checked")
        folder = self._open_folder(relative, source)
        temp = self.root / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            self.stage("opened")
            copied = self._copy(folder, temp, source)
            digest = folder_digest(temp)
            if copied is not None and copied != digest:
                raise ContentError(f"the copy of {source} does not hash to what was read ({copied} != {digest})")
            _check_weights(temp, source)
            self.stage("copied")
            stored = self._publish(temp, digest, source)
        finally:
            os.close(folder)
            shutil.rmtree(temp, ignore_errors=True)
        log_event(log, "content_stored", source=source, path=stored.path, fingerprint=stored.fingerprint)
        self.stage("stored")
        return stored

    def _open_folder(self, relative: PurePosixPath, source: str) -> int:
        """The descriptor of ADAPTER_ROOT/`relative`, opened one name at a time from the root, no symlink followed,
        never the store or `.fleet/`."""
        proxy_folders = (self.root, fleet_dir(self.adapter_root))
        if any(_names(relative, folder, self.adapter_root) for folder in proxy_folders):
            raise ContentError(self._proxy_folder(source))
        own = {_identity(folder) for folder in proxy_folders} - {None}  # the same folders by any other name
        current = os.open(self.adapter_root, FOLDER_FLAGS)
        walked = self.adapter_root
        try:
            for part in relative.parts:
                walked = walked / part
                try:
                    opened = os.open(part, FOLDER_FLAGS | NOFOLLOW, dir_fd=current)
                except FileNotFoundError:
                    raise NoAdapter(f"No adapter found for {source}: {walked} does not exist") from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ContentError(f"adapter path {source}: {walked} is not a plain folder (a symlink or a "
                                           "file): refused, a load reads only plain folders of plain files") from None
                    raise ContentError(f"adapter path {source}: cannot open {walked}: {exc}") from None
                os.close(current)
                current = opened
                if _identity(current) in own:
                    raise ContentError(self._proxy_folder(source))
        except BaseException:
            os.close(current)
            raise
        return current

    def _proxy_folder(self, source: str) -> str:
        return (f"lora_path {source} lies in the proxy's own folders (the content store {self.root} or "
                f"{fleet_dir(self.adapter_root)}): only the proxy names those; load the adapter from the folder it "
                "was published to")

    def _copy(self, folder: int, temp: Path, source: str) -> str | None:
        """Copy the adapter's files of `folder` into `temp`; the hex digest of what was read (None: reflinked)."""
        names = adapter_files(os.listdir(folder))
        if CONFIG_FILE not in names:
            raise NoAdapter(f"No adapter found for {source}: no {CONFIG_FILE} there")
        if not any(name.endswith(WEIGHTS_SUFFIX) for name in names):  # vLLM: 500 "doesn't contain tensors"
            raise ContentError(f"adapter path {source} has {CONFIG_FILE} but no weights file (*{WEIGHTS_SUFFIX}): a "
                               "load needs the adapter's weights as safetensors")
        os.mkdir(temp, FOLDER_MODE)
        digest, cloned, budget = ContentHash(), False, self.max_bytes
        for name in names:
            shown = f"{source}/{name}"
            try:
                src = os.open(name, FILE_FLAGS | NOFOLLOW, dir_fd=folder)
            except OSError as exc:
                raise ContentError(f"adapter file {shown} cannot be opened as a plain file: {exc}") from None
            try:
                before = _plain(os.fstat(src), shown, budget)
                budget -= before.st_size
                dst = os.open(temp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
                try:
                    if _reflink(src, dst):
                        cloned, length = True, os.fstat(dst).st_size
                    else:
                        length = _copy_hashing(src, dst, name, digest)
                finally:
                    os.close(dst)
                _unchanged(before, os.fstat(src), length, shown)
            finally:
                os.close(src)
        return None if cloned else digest.hexdigest()

    def _publish(self, temp: Path, digest: str, source: str) -> Stored:
        """Rename `temp` to its hash (atomic); an existing folder of that name is reused once it verified."""
        final = self.root / digest
        with self._lock:
            try:
                os.rename(temp, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                if not self._verify_locked(digest):
                    shutil.rmtree(final)
                    os.rename(temp, final)
            self._verified.add(digest)
            self._since[digest] = self.clock()  # a fresh grace period for the load that is starting
        return Stored(str(final), FINGERPRINT_PREFIX + digest, source)

    # --- reuse ------------------------------------------------------------------------------------
    def verify(self, path: str) -> str:
        """Why the store folder `path` may not be served ("" when it may): not a store folder, missing, or content
        that does not hash to its name. Hashed once per proxy start. Blocking."""
        digest = self.digest_of(path)
        if digest is None:
            return f"{path} is not a folder of the content store {self.root}"
        with self._lock:
            if not (self.root / digest).is_dir():
                return f"its store folder {path} is missing"
            if not self._verify_locked(digest):
                return f"the content of its store folder {path} does not hash to its name"
            self._since[digest] = self.clock()
        return ""

    def _verify_locked(self, digest: str) -> bool:
        if digest in self._verified:
            return True
        try:
            ok = folder_digest(self.root / digest) == digest
        except OSError:
            ok = False
        if ok:
            self._verified.add(digest)
        else:
            log_event(log, "content_corrupt", logging.ERROR, path=self.path_of(digest))
        return ok

    # --- garbage collection -----------------------------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, stored: Stored) -> Iterator[None]:
        """Hold `stored` against collection for the duration of a load."""
        digest = Path(stored.path).name
        with self._lock:
            self._pins[digest] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]
                self._since[digest] = self.clock()

    def collect(self, referenced: Collection[str]) -> list[str]:
        """Delete the store folders not in `referenced` (store paths), not pinned, and idle past the grace period;
        also temporary folders no ingest of this process is writing. Returns the deleted paths. Blocking."""
        names = {Path(path).name for path in referenced}
        deleted = []
        with self._lock:
            now = self.clock()
            try:
                listing = os.listdir(self.root)
            except FileNotFoundError:
                return []
            for name in listing:
                if name.startswith(TEMP_PREFIX) or not HEX_NAME.fullmatch(name):
                    continue  # an ingest in flight owns its temporary folder; leftovers go at start (`sweep`)
                if name in names or self._pins[name] > 0:
                    self._since[name] = now
                    continue
                if now - self._since.setdefault(name, now) < self.grace_s:
                    continue
                shutil.rmtree(self.root / name, ignore_errors=True)
                self._since.pop(name, None)
                self._verified.discard(name)
                deleted.append(self.path_of(name))
        for path in deleted:
            log_event(log, "content_collected", path=path)
        return deleted

    def sweep(self) -> None:
        """At start: temporary folders are leftovers of a proxy that died mid-copy."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                if name.startswith(TEMP_PREFIX):
                    shutil.rmtree(self.root / name, ignore_errors=True)


def _check_weights(folder: Path, source: str) -> None:
    """Every weights file of the copy reads as a safetensors file (lorafleet.safetensors_header): vLLM would answer a
    broken one with a 500, the tenant's file being at fault."""
    for name in adapter_files(os.listdir(folder)):
        if not name.endswith(WEIGHTS_SUFFIX):
            continue
        fd = os.open(folder / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            problem = header_problem(fd)
        finally:
            os.close(fd)
        if problem:
            raise ContentError(f"adapter file {source}/{name} is not a readable safetensors file: {problem}")


def _reflink(src: int, dst: int) -> bool:
    """Clone `src` into `dst` where the filesystem shares extents (FICLONE); False where it cannot (ext4, tmpfs)."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
    except OSError:
        return False
    return True


def _identity(path: Path | int) -> tuple[int, int] | None:
    """(device, inode) of `path` or of an open descriptor; None when it does not exist."""
    try:
        info = os.fstat(path) if isinstance(path, int) else os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _names(relative: PurePosixPath, folder: Path, root: Path) -> bool:
    """Whether `relative` (under `root`) names `folder` or something in it, as written."""
    try:
        parts = confine(folder, root).parts
    except AdapterPathError:
        return False  # the folder lies outside the root: the walk never reaches it
    return relative.parts[:len(parts)] == parts


def _plain(info: os.stat_result, shown: str, budget: int) -> os.stat_result:
    """`info` when it is a file a load may copy: regular, one link, not empty, within what is left of the bound."""
    if not stat.S_ISREG(info.st_mode):
        raise ContentError(f"adapter file {shown} is not a regular file (a FIFO, device, socket or folder): refused")
    if info.st_nlink != 1:
        raise ContentError(f"adapter file {shown} has {info.st_nlink} hard links: refused, a load copies only files "
                           "that exist once (a hard link could name another run's file)")
    if info.st_size == 0:
        raise ContentError(f"adapter file {shown} is empty: refused")
    if info.st_size > budget:
        raise ContentError(f"adapter file {shown} ({info.st_size} bytes) passes what is left of PROXY_ADAPTER_MAX_MB "
                           f"for this adapter ({max(budget, 0)} bytes): refused")
    return info


def _unchanged(before: os.stat_result, after: os.stat_result, length: int, shown: str) -> None:
    """Refuse a file that changed while it was copied: its size or mtime moved, or another length was read."""
    if (after.st_size, after.st_mtime_ns, length) != (before.st_size, before.st_mtime_ns, before.st_size):
        raise ContentError(f"adapter file {shown} changed while it was copied ({before.st_size} bytes before, "
                           f"{length} read, {after.st_size} after): refused, publish a version once it is complete")


def _copy_hashing(src: int, dst: int, name: str, digest: ContentHash) -> int:
    """Copy `src` to `dst` hashing what is read; the number of bytes copied."""
    digest.start(name)
    length = 0
    while chunk := os.read(src, CHUNK):
        digest.update(chunk)
        length += len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
    digest.end()
    return length
