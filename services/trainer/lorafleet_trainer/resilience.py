"""Let TRL's control calls (pause, load, resume, unload) ride out a proxy restart.

TRL 1.16's `VLLMClient` sends each sync call once with plain `requests`: a proxy that is
restarting (a new image, a crash, `docker compose up` after a config change) refuses the
connection for a second or two, and that one refusal kills the run in the middle of a sync.
Rollouts wait for the fleet in fleet_rollouts.py. Here the control calls get the same treatment for the
failures a proxy gone or coming back gives: a refused connection (it never reached the proxy), the proxy's 503
(it did nothing: no ready replica yet), its 502 (a replica failed the broadcast, e.g. died mid-load, and the change
was rolled back on every replica: nothing done either), and a connection lost before any answer (the proxy died with
the call in flight). Replaying each is safe because every control call TRL makes is idempotent at the proxy: a load
of a name at the path the ledger already has is a success without a change, pause and resume set a state, and TRL
ignores the status of an unload. All are waited out up to TRAINER_FLEET_WAIT_S, each retry logged
(`event=control_call_waiting`): urllib3's own retry warnings go to the NullHandler it installs, so a trainer whose
sync met a stopped proxy waited a minute without a line. Other statuses are not retried; TRL's own handling of those
stays as it is.
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import requests
from lorafleet.logs import log_event
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from lorafleet_trainer import trl_seam
from lorafleet_trainer.proxy_client import RETRY_STATUSES, ProxyClient

log = logging.getLogger(__name__)

# Connection attempts with a 0.5 s doubling backoff, capped at RETRY_MAX_S: back on the fleet within seconds of its
# return. CONNECT_RETRIES (the default without a fleet wait) rides out ~30 s; retries_for(wait) about `wait`.
CONNECT_RETRIES = 10
BACKOFF_S = 0.5
RETRY_MAX_S = 5.0


def retries_for(wait_s: float) -> int:
    """Attempts whose backoff adds up to at least `wait_s` (TRAINER_FLEET_WAIT_S)."""
    return max(1, math.ceil(wait_s / RETRY_MAX_S)) + 4  # the first four sleep less than RETRY_MAX_S together


class LoggedRetry(Retry):
    """urllib3's Retry that logs each retry it grants on the trainer's logger, with what failed and the wait."""

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None, _stacktrace: Any = None) -> LoggedRetry:
        granted = super().increment(method, url, response, error, _pool, _stacktrace)  # raises once spent
        cause = f"{type(error).__name__}: {error}" if error is not None else f"HTTP {getattr(response, 'status', '?')}"
        log_event(log, "control_call_waiting", logging.WARNING, call=f"{method} {url}", cause=cause,
                  attempt=len(granted.history), retry_in_s=round(granted.get_backoff_time(), 1),
                  reason="waiting for the fleet, up to TRAINER_FLEET_WAIT_S")
        return granted


def retrying_session(connect_retries: int = CONNECT_RETRIES, backoff_s: float = BACKOFF_S) -> requests.Session:
    """A Session that re-sends a request when the connection could not be made, was lost before the answer, or the
    proxy said 503, logging each retry (LoggedRetry)."""
    retry = LoggedRetry(
        total=None, connect=connect_retries, read=connect_retries, status=connect_retries, other=0, redirect=0,
        status_forcelist=RETRY_STATUSES, backoff_factor=backoff_s, backoff_max=RETRY_MAX_S, allowed_methods=None,
        raise_on_status=False,
    )  # fmt: skip
    adapter = HTTPAdapter(max_retries=retry)
    session = requests.Session()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def retry_control_calls(session: requests.Session | None = None, *, proxy: ProxyClient | None = None,
                        fleet_wait_s: float | None = None) -> None:
    """Point TRL's VLLMClient module at `requests` whose get/post wait for the fleet (refused connections, 503) up
    to `fleet_wait_s` (TRAINER_FLEET_WAIT_S) and send `proxy`'s headers (its run key; none without a proxy given)."""
    retries = CONNECT_RETRIES if fleet_wait_s is None else retries_for(fleet_wait_s)
    active = session or retrying_session(retries)
    active.headers.update(proxy.headers if proxy else {})
    public = {name: getattr(requests, name) for name in dir(requests) if not name.startswith("__")}
    shim: Any = types.SimpleNamespace(**public)
    shim.get, shim.post = active.get, active.post
    trl_seam.set_control_requests(shim)
