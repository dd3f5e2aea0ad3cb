"""Pause elision: the trainer's `keep` pause around an adapter load is answered without pausing replicas.

Under PROXY_SYNC_PAUSE=elide a `keep` pause from the fleet port (a run's, the default run's included) and the resume
that follows it touch no replica; `abort`/`wait` pauses and everything on the public port are still broadcast.
Safe because every sync loads a new name and never changes the weights behind one in use: docs/concepts/sync.md.
"""

from __future__ import annotations

from lorafleet.runs import DEFAULT_RUN
from starlette.types import Scope

from .auth import on_public_port


class PauseElision:
    """Decides, per request, whether a pause or resume is elided; remembers an elided pause until its resume.

    How long a broadcast pause held the replicas is timed by the metrics (`Metrics.track_pause`).
    """

    def __init__(self, mode: str) -> None:
        self.enabled = mode == "elide"
        self.pending: set[str] = set()  # runs whose keep pause was elided and whose resume has not come yet

    def elide_pause(self, scope: Scope, mode: str, run: str = DEFAULT_RUN) -> bool:
        # A broadcast pause clears an earlier elided one: the resume that follows must reach the replicas.
        if self.enabled and mode == "keep" and not on_public_port(scope):
            self.pending.add(run)
            return True
        self.pending.discard(run)
        return False

    def elide_resume(self, scope: Scope, run: str = DEFAULT_RUN) -> bool:
        """Only the fleet port's resume after an elided pause of the same run; any other resume is broadcast."""
        if run in self.pending and not on_public_port(scope):
            self.pending.discard(run)
            return True
        return False
