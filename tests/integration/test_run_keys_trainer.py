"""A real `lorafleet-train` as a named run on a fleet with run keys (issue 34), over the session's real replicas.

Without its key the trainer is refused at its first call and publishes nothing; with it (TRAINER_RUN_KEY_FILE)
every client it has — lorafleet's preflight, TRL's control calls and TRL's spawned rollout child — sends the key:
it trains, publishes under its run's names, and the proxy refused none of its requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from lorafleet.run_key_store import provision, write_private
from lorafleet_ops.processes import Service
from lorafleet_testing.trainers import finish
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

RUN = "keyed"
STEPS = 2
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def keyed_fleet(shared_replicas: list[Service], start_proxy: Callable[..., Service], root: Path) \
        -> Iterator[tuple[Service, Path, str]]:
    """A proxy with run keys in front of the shared replicas; run `keyed` has a key (in a 0600 file)."""
    key = provision(root / "run-keys", RUN)
    key_file = root / "keyed.key"
    write_private(key_file, key)
    proxy = start_proxy(shared_replicas, root=root, RUN_KEYS_DIR=str(root / "run-keys"))
    yield proxy, key_file, key
    auth = {"Authorization": f"Bearer {key}"}
    base = f"{proxy.url}/runs/{RUN}"
    for card in httpx.get(base + "/v1/models", headers=auth, timeout=10).json()["data"][1:]:
        httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, headers=auth, timeout=60)
    proxy.stop()


def refused(proxy: Service) -> float:
    """Requests the proxy answered 401 or 403 (its requests counter, by status)."""
    families = text_string_to_metric_families(httpx.get(proxy.url + "/metrics", timeout=10).text)
    return sum(sample.value for family in families if family.name == "lorafleet_proxy_requests"
               for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("status") in ("401", "403"))


def test_without_its_key_the_trainer_is_refused_and_publishes_nothing(keyed_fleet, root, start_trainer):
    proxy, _, _ = keyed_fleet
    trainer = start_trainer("trainer-keyless", root, RUN, f"{proxy.url}/runs/{RUN}", MAX_STEPS=STEPS,
                            HF_HUB_OFFLINE="1")
    code, log = finish(trainer, RUN_TIMEOUT_S)
    assert code != 0, log[-3000:]
    assert "needs its run key" in log, log[-3000:]
    assert not (root / "runs" / RUN / ".vllm_lora").exists() or not any((root / "runs" / RUN / ".vllm_lora").iterdir())
    ledger = httpx.get(proxy.url + "/fleet", timeout=10).json()["ledger"]
    assert not [entry for entry in ledger if entry["name"].startswith(f"{RUN}--")], ledger


def test_with_its_key_every_client_of_the_trainer_sends_it(keyed_fleet, root, start_trainer, served_adapters,
                                                           shared_replicas):
    proxy, key_file, key = keyed_fleet
    before = refused(proxy)
    trainer = start_trainer("trainer-keyed", root, RUN, f"{proxy.url}/runs/{RUN}", MAX_STEPS=STEPS,
                            TRAINER_RUN_KEY_FILE=str(key_file), HF_HUB_OFFLINE="1")
    code, log = finish(trainer, RUN_TIMEOUT_S)
    assert code == 0, log[-4000:]
    assert key not in log  # the key is never logged
    assert refused(proxy) == before, "the proxy refused some request of the keyed trainer"
    for replica in shared_replicas:
        names = set(served_adapters(replica.url))
        assert {f"{RUN}--trl-policy-v{v}" for v in range(1, STEPS + 2)} <= names, (replica.url, names)
