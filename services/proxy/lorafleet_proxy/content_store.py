"""The content store: what replicas load, written only by the proxy and named by its content.

A trainer writes its own run folder, so between the proxy's check of a load's path and a replica's read of it, the
trainer could swap a directory of the path for a symlink into another run's files. The proxy therefore never sends a
replica a path a trainer can change: at load it copies the adapter's files into `<store>/<hex>/` (hex: the sha256 of
`lorafleet.ledger_format.fingerprint`) and the replicas load that folder, which only the proxy writes.

The copy reads through file descriptors opened once: the walk from ADAPTER_ROOT to the adapter's folder opens every
component with O_NOFOLLOW relative to the one before (a symlink planted anywhere after the check fails the walk), and
each file is opened relative to the folder's descriptor, with O_NOFOLLOW, and must be a regular file. The files go
into a temporary folder of the store (a reflink where the filesystem offers one, else a copy hashed on the way), are
hashed again as written, and the folder is renamed to its hash: a store folder is complete or absent while the
machine runs, and its name is its content. A folder of that name that already exists holds the same content by
construction; it is hashed once per proxy start before it is reused. Nothing is fsynced: a power cut may leave a
folder torn, and that hash check finds it (a restored ledger drops the entry, saying why; a new load replaces the
folder), and a publish does not wait on the disk four times (`make bench-store-cost`).

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
from pathlib import Path

from lorafleet.ledger_format import CHUNK, CONFIG_FILE, FINGERPRINT_PREFIX, ContentHash, adapter_files
from lorafleet.logs import log_event

__all__ = ["ContentError", "ContentStore", "NoAdapter", "Stored"]

log = logging.getLogger("lorafleet.proxy.content")

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), share the source's extents (btrfs, xfs, ...)
HEX_NAME = re.compile(r"^[0-9a-f]{64}$")
TEMP_PREFIX = ".tmp-"
FOLDER_MODE, FILE_MODE = 0o755, 0o444  # replicas read; nobody writes a published file again


class ContentError(ValueError):
    """The adapter cannot be taken into the store as checked (a symlink, not a regular file, unreadable)."""


class NoAdapter(ContentError):
    """The folder has no adapter_config.json (yet): the trainer's files may not have reached this volume."""


@dataclass(frozen=True)
class Stored:
    """One content of the store: the folder replicas load and its fingerprint (`sha256:<hex>`, hex = folder name)."""

    path: str
    fingerprint: str


class ContentStore:
    """`<root>/<hex>/` folders copied from adapter folders under `adapter_root`; see the module docstring."""

    def __init__(self, root: Path, adapter_root: Path, grace_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.adapter_root = adapter_root
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

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path`, resolved, is the store or lies inside it (a load may never name it)."""
        real = Path(path).resolve()
        root = self.root.resolve()
        return real == root or root in real.parents

    def digest_of(self, path: str) -> str | None:
        """The hex name of a store folder path, or None when `path` is not `<root>/<hex>`."""
        candidate = Path(path)
        if candidate.parent != self.root or not HEX_NAME.fullmatch(candidate.name):
            return None
        return candidate.name

    # --- ingest -----------------------------------------------------------------------------------
    def ingest(self, source: str) -> Stored:
        """Copy the adapter at `source` (a resolved path under ADAPTER_ROOT, checked by the caller) into the store.

        Blocking: the proxy runs it in a thread. Raises NoAdapter, ContentError."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.stage("checked")
        folder = self._open_folder(Path(source))
        temp = self.root / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            self.stage("opened")
            copied = self._copy(folder, temp, source)
            digest = self._hash_folder(temp)
            if copied is not None and copied != digest:
                raise ContentError(f"the copy of {source} does not hash to what was read ({copied} != {digest})")
            self.stage("copied")
            stored = self._publish(temp, digest)
        finally:
            os.close(folder)
            shutil.rmtree(temp, ignore_errors=True)
        log_event(log, "content_stored", source=source, path=stored.path, fingerprint=stored.fingerprint)
        self.stage("stored")
        return stored

    def _open_folder(self, source: Path) -> int:
        """The descriptor of `source`, reached from ADAPTER_ROOT one component at a time, no symlink followed."""
        root = self.adapter_root.resolve()
        try:
            parts = source.relative_to(root).parts
        except ValueError:
            raise ContentError(f"adapter path {source} is not under the adapter root {root}") from None
        current = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        walked = root
        try:
            for part in parts:
                walked = walked / part
                try:
                    opened = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
                except FileNotFoundError:
                    raise NoAdapter(f"No adapter found for {source}: {walked} does not exist") from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ContentError(f"adapter path {source}: {walked} is not a plain folder (a symlink or a "
                                           "file, swapped in after the proxy checked the path?): refused") from None
                    raise ContentError(f"adapter path {source}: cannot open {walked}: {exc}") from None
                os.close(current)
                current = opened
        except BaseException:
            os.close(current)
            raise
        return current

    def _copy(self, folder: int, temp: Path, source: str) -> str | None:
        """Copy the adapter's files of `folder` into `temp`; the hex digest of what was read (None: reflinked)."""
        names = adapter_files(os.listdir(folder))
        if CONFIG_FILE not in names:
            raise NoAdapter(f"No adapter found for {source}: no {CONFIG_FILE} there")
        os.mkdir(temp, FOLDER_MODE)
        digest, cloned = ContentHash(), False
        for name in names:
            try:
                src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except OSError as exc:
                raise ContentError(f"adapter file {source}/{name} cannot be opened as a plain file: {exc}") from None
            try:
                if not stat.S_ISREG(os.fstat(src).st_mode):
                    raise ContentError(f"adapter file {source}/{name} is not a regular file")
                dst = os.open(temp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                try:
                    if _reflink(src, dst):
                        cloned = True
                    else:
                        _copy_hashing(src, dst, name, digest)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        return None if cloned else digest.hexdigest()

    def _hash_folder(self, folder: Path) -> str:
        digest = ContentHash()
        for name in adapter_files(os.listdir(folder)):
            digest.start(name)
            with open(folder / name, "rb") as handle:
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
            digest.end()
        return digest.hexdigest()

    def _publish(self, temp: Path, digest: str) -> Stored:
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
        return Stored(str(final), FINGERPRINT_PREFIX + digest)

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
            ok = self._hash_folder(self.root / digest) == digest
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


def _reflink(src: int, dst: int) -> bool:
    """Clone `src` into `dst` where the filesystem shares extents (FICLONE); False where it cannot (ext4, tmpfs)."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
    except OSError:
        return False
    return True


def _copy_hashing(src: int, dst: int, name: str, digest: ContentHash) -> None:
    digest.start(name)
    while chunk := os.read(src, CHUNK):
        digest.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
    digest.end()
