"""The trainer's one description of the proxy it talks to: the URL (TRAINER_VLLM_URL, the run's `/runs/<run>` prefix
included), the run's bearer key, and the statuses the proxy answers when it did nothing (safe to send again).

Every call the trainer makes to the proxy gets its URL and headers here: the start-up checks and sweep
(`control`, fleet_preflight.py), TRL's control calls (resilience.py's session), the rollout child's session
(fleet_rollouts.py), the eval passes (`http`, evaluation.py) and the ratio reports (`post`, ratio_report.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from lorafleet.runs import url_run
from lorafleet.settings import TrainerSettings
from lorafleet.vllm_api import VLLMClient

from lorafleet_trainer.run_key_file import bearer

# The proxy's 503 (no ready replica yet, its ledger being rebuilt) and 502 (a broadcast a replica failed, rolled back
# on every replica) both mean nothing was done: the call may be sent again once the fleet is back.
RETRY_STATUSES = (502, 503)


@dataclass(frozen=True)
class ProxyClient:
    """Where the proxy is and how this run is known to it."""

    url: str
    run_key: str = ""  # "" = none (run keys off)

    @classmethod
    def from_settings(cls, settings: TrainerSettings, run_key: str) -> ProxyClient:
        return cls(settings.trainer_vllm_url.rstrip("/"), run_key)

    @property
    def headers(self) -> dict[str, str]:
        """The run key as a Bearer header; none without a key (never logged)."""
        return bearer(self.run_key)

    @property
    def run(self) -> str:
        """The run the URL names (`/runs/<run>`), the default run's name without a prefix."""
        return url_run(self.url)

    def route(self, path: str) -> str:
        return self.url + path

    def control(self) -> VLLMClient:
        """lorafleet's typed client for the start-up checks, the registration and the sweep."""
        return VLLMClient(self.url, token=self.run_key)

    def http(self, timeout: float) -> httpx.AsyncClient:
        """An async HTTP client rooted at the URL, sending the key (the eval passes' completions)."""
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float) -> httpx.Response:
        """One synchronous POST of `body` to `path` (a ratio report), sending the key."""
        return httpx.post(self.route(path), json=body, headers=self.headers, timeout=timeout)
