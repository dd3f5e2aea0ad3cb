"""A replica whose importance ratio departs from its peers' (ratio_outliers.outliers), reported to the proxy.

The report goes to the proxy's `POST /ratio_report` (TRAINER_VLLM_URL: the run's own prefix, with the run's key
where keys are on) naming the replica, the run's adapter and the evidence; the proxy treats it as a canary
disagreement (docs/concepts/provenance.md). The adapter named is the newest version of the judged window: the
sequential test may name a replica on evidence from versions the fleet has unloaded since, and a replica decoding
with other weights does so for every adapter. Each (replica, version) is reported once. The post runs on a thread
of its own, so a slow or absent proxy never holds the training step; its answer is logged.

Rollouts the replica generated before are not dropped: they are counted and flagged (metrics.jsonl names the
outlier beside its rows, rollouts.jsonl names the replica of every sample). By the time a window is judged its
tokens are already in the gradient (judging needs the trainer's forward of those very tokens), and PPO's clipped
ratio bounds what each of them moves the policy.
"""

from __future__ import annotations

import logging
import threading

import httpx
from lorafleet.adapters import policy_name
from lorafleet.logs import log_event
from lorafleet.ratio_outliers import Outlier

from lorafleet_trainer.proxy_client import ProxyClient

log = logging.getLogger(__name__)
ROUTE = "/ratio_report"
TIMEOUT_S = 30.0


class RatioReporter:
    """Posts each new outlier to the proxy, once per (replica, version), off the training thread."""

    def __init__(self, proxy: ProxyClient) -> None:
        self.proxy = proxy
        self.reported: set[tuple[str, int]] = set()
        self.threads: list[threading.Thread] = []

    def report(self, outliers: list[Outlier], newest: int) -> None:
        """Report each outlier under `newest`, the judged window's newest version (still served)."""
        for outlier in outliers:
            if (outlier.replica, newest) in self.reported:
                continue
            self.reported.add((outlier.replica, newest))
            log_event(log, "ratio_outlier", logging.WARNING, replica=outlier.replica,
                      adapter=policy_name(newest), evidence=outlier.evidence())
            thread = threading.Thread(target=self.post, args=(outlier, newest), name="ratio-report", daemon=True)
            thread.start()
            self.threads = [*[t for t in self.threads if t.is_alive()], thread]

    def post(self, outlier: Outlier, newest: int) -> None:
        body = {"replica": outlier.replica, "lora_name": policy_name(newest), "evidence": outlier.evidence()}
        try:
            response = self.proxy.post(ROUTE, body, timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            log_event(log, "ratio_report_failed", logging.WARNING, replica=outlier.replica, reason=str(exc))
            return
        if response.is_success:
            log_event(log, "ratio_reported", replica=outlier.replica, adapter=body["lora_name"],
                      outcome=response.json().get("outcome"))
        else:
            log_event(log, "ratio_report_refused", logging.WARNING, replica=outlier.replica,
                      status=response.status_code, reason=response.text[:500])
