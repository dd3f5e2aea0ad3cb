"""Let TRL's control calls (pause, load, resume, unload) ride out a proxy restart.

TRL 1.16's `VLLMClient` sends each sync call once with plain `requests`: a proxy that is
restarting (a new image, a crash, `docker compose up` after a config change) refuses the
connection for a second or two, and that one refusal kills the run in the middle of a sync.
Rollouts already survive it (the rollout worker retries). Here the control calls get the same
treatment, but only for connection errors: a refused connection never reached the proxy, so
sending it again cannot apply a state change twice. Read errors and HTTP statuses are not
retried; TRL's own handling of those stays as it is. The same session carries the run key (run_key.py), so
every control call TRL makes (all of them go through this module's `requests.get/post`) sends it.
"""

from __future__ import annotations

import types
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from lorafleet_trainer.run_key import bearer

# 10 connection attempts with 0.5 s doubling backoff (capped by urllib3 at 120 s) ride out ~2 minutes.
CONNECT_RETRIES = 10
BACKOFF_S = 0.5


def retrying_session(connect_retries: int = CONNECT_RETRIES, backoff_s: float = BACKOFF_S) -> requests.Session:
    """A Session that re-sends a request only when the connection could not be made."""
    retry = Retry(
        total=None, connect=connect_retries, read=0, status=0, other=0, redirect=0,
        backoff_factor=backoff_s, allowed_methods=None, raise_on_status=False,
    )  # fmt: skip
    adapter = HTTPAdapter(max_retries=retry)
    session = requests.Session()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def retry_control_calls(session: requests.Session | None = None, *, run_key: str = "") -> None:
    """Point TRL's VLLMClient module at `requests` whose get/post retry refused connections (and send `run_key`)."""
    from trl.experimental.async_grpo import vllm_client

    active = session or retrying_session()
    active.headers.update(bearer(run_key))
    public = {name: getattr(requests, name) for name in dir(requests) if not name.startswith("__")}
    shim: Any = types.SimpleNamespace(**public)
    shim.get, shim.post = active.get, active.post
    vllm_client.requests = shim
