"""Stop signals that arrive while the trainer starts, held until training can act on them.

In a container the trainer is PID 1, and the kernel drops every signal PID 1 has no handler for. Without a handler
from the first instant, a `docker compose stop` during the seconds of start-up (task, configs, the fleet's checks)
is lost: training starts, and the stop ends 90 s later in SIGKILL, without a checkpoint. The console script installs
`hold` before anything else; RunLifecycle (lifecycle.py) or the rank launcher (ranks.py) takes over with `take`.
A second signal while starting exits at once, as it does later.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_held: list[int] = []


def _hold(signum: int, _frame: FrameType | None) -> None:
    if _held:  # asked twice: nothing has started that a stop would need to save
        os._exit(128 + signum)
    else:
        _held.append(signum)


def hold() -> None:
    """Keep the first stop signal from now on (see `take`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _hold)


def take() -> int | None:
    """The stop signal held since `hold`, if one came (and forget it)."""
    return _held.pop() if _held else None
