"""The adapter disk filling up: each run's folder on a small tmpfs of its own, which the nemesis fills to the
trainer's free-disk threshold (TRAINER_MIN_FREE_GB) and empties again.

The trainer measures free space on its run folder (lifecycle.Limits.volume); a filesystem the harness owns is the
only honest one to fill: filling the box's own disk would starve every other process on it, and a threshold set
just under the box's free space would trip on anyone's writes. Mounting a tmpfs needs root (CI and the dev box run
as root); without it the form leaves the fault out (`unavailable`). The fill leaves half the threshold free, never
an ENOSPC: the fault is the threshold crossed, not a write failing. At the end the folder's files are copied off the
tmpfs and back onto the disk beneath, so the checker reads them after the mount is gone.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

from lorafleet.logs import log_event

SIZE_MB = 128  # a run folder of the tiny task stays under 10 MB over the long form
THRESHOLD_MB = 32  # the trainers' TRAINER_MIN_FREE_GB under chaos
FILL = ".disk-fill"
MB = 1024**2
GB = 1024**3


def unavailable(probe_parent: Path) -> str | None:
    """Why run folders cannot be tmpfs mounts here (None when they can): tried once on a scratch folder."""
    probe_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=probe_parent) as scratch:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", scratch], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            return f"cannot mount a tmpfs (root needed): {done.stderr.strip() or done.returncode}"
        subprocess.run(["umount", scratch], check=True)
    return None


class RunDisk:
    """One run folder on its own tmpfs; `fill` crosses the trainer's threshold, `heal` frees it again."""

    def __init__(self, folder: Path, log: logging.Logger) -> None:
        self.folder, self.log = folder, log
        self.threshold_gb = THRESHOLD_MB * MB / GB

    def mount(self) -> RunDisk:
        self.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(self.folder)], check=True)
        return self

    def fill(self) -> None:
        free = shutil.disk_usage(self.folder).free
        size = max(0, free - THRESHOLD_MB * MB // 2)
        with open(self.folder / FILL, "wb") as out:
            out.truncate(0)
            for _ in range(size // MB):  # written, not sparse: tmpfs counts only what is written
                out.write(b"\0" * MB)
        log_event(self.log, "chaos_disk_filled", folder=str(self.folder),
                  free_mb=shutil.disk_usage(self.folder).free // MB)

    def heal(self) -> None:
        (self.folder / FILL).unlink(missing_ok=True)

    def unmount(self) -> None:
        """Copy the folder's files off the tmpfs, unmount it, and put them back on the disk beneath."""
        self.heal()
        with tempfile.TemporaryDirectory() as kept:
            copy = Path(kept) / "run"
            shutil.copytree(self.folder, copy, symlinks=True)
            if subprocess.run(["umount", str(self.folder)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(self.folder)], check=True)
            shutil.copytree(copy, self.folder, symlinks=True, dirs_exist_ok=True)
