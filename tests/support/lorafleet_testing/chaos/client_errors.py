"""The errors a trainer (the fleet's client) met, against what the docs promise it retries.

docs/guides/preemption.md ("The proxy gone"): rollouts retry a refused or reset connection, a time-out, a connection
lost before the answer, a 5xx, a 408 or a 429, logging `rollout waiting for the fleet: <error>`; control calls retry a
refused connection, a connection lost before the answer and the proxy's 502 and 503 (`event=control_call_waiting
cause=...`), and the start-up checks a proxy gone (`cause="ConnectionError`) or its 502/503; all wait up to
TRAINER_FLEET_WAIT_S. docs/guides/preemption.md ("Stopping on purpose") adds the one
refusal a start may meet under chaos: too little free disk (`event=refused`, exit 3). Anything else a trainer's log
shows (another error retried, a rollout that gave up, another refusal, a start that crashed) is an error the docs do
not promise to ride out. The proxy's log is not read: what a client saw is in the client's log.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

Finding = tuple[str, Any]

# aiohttp's names for what the rollout retry promises: refused, reset, timed out, lost before the answer.
ROLLOUT_RETRIED = frozenset({
    "ClientConnectorError", "ClientConnectionError", "ClientConnectionResetError", "ConnectionResetError",
    "ClientOSError", "ServerDisconnectedError", "ClientPayloadError", "ServerTimeoutError", "ConnectionTimeoutError",
    "SocketTimeoutError", "TimeoutError",
})
ROLLOUT_STATUSES = frozenset({408, 429})  # and every 5xx
# urllib3's and requests' names for a refused connection or one lost before the answer; "HTTP 503" is the status.
CONTROL_RETRIED = frozenset({"NewConnectionError", "ConnectionRefusedError", "ProtocolError", "RemoteDisconnected",
                             "ConnectionResetError", "ConnectionError", "HTTP 502", "HTTP 503"})
EXIT_REFUSED = 3  # the trainer's EXIT_PREFLIGHT: a refusal, its reason logged as event=refused
EXITS_EXPECTED = frozenset({0, -9, EXIT_REFUSED})  # done or stopped with a checkpoint, the nemesis's SIGKILL, refused
LOW_DISK = "TRAINER_MIN_FREE_GB"

ROLLOUT_WAIT = re.compile(r"rollout waiting for the fleet: (\w+): (.*?); \d+s of TRAINER_FLEET_WAIT_S")
CONTROL_WAIT = re.compile(r'event=control_call_waiting .*?cause="(HTTP \d+|\w+)')
GAVE_UP = "rollout gave up"
REFUSED = re.compile(r"event=refused reason=\"?(.*)")


def _rollout_promised(kind: str, message: str) -> bool:
    if kind == "ClientResponseError":
        status = re.match(r"(\d{3})", message)
        return status is not None and (int(status.group(1)) >= 500 or int(status.group(1)) in ROLLOUT_STATUSES)
    return kind in ROLLOUT_RETRIED


def error_findings(log: str, exits: Sequence[int]) -> Iterator[Finding]:
    """Each error in a trainer's log (over all its starts) and each start's exit the docs do not promise."""
    for line in log.splitlines():
        if (rollout := ROLLOUT_WAIT.search(line)) and not _rollout_promised(rollout.group(1), rollout.group(2)):
            yield f"a rollout met {rollout.group(1)}, not an error the docs say it retries", line
        elif (control := CONTROL_WAIT.search(line)) and control.group(1) not in CONTROL_RETRIED:
            yield f"a control call met {control.group(1)}, not an error the docs say it retries", line
        elif GAVE_UP in line:
            yield "a rollout gave up waiting for the fleet", line
        elif (refused := REFUSED.search(line)) and LOW_DISK not in refused.group(1):
            yield "a start refused to run for another reason than low disk", line
    for start, code in enumerate(exits):
        if code not in EXITS_EXPECTED:
            crash = [line for line in log.splitlines() if "Error" in line or "Traceback" in line]
            yield f"start {start + 1} exited {code}", crash[-1] if crash else None
