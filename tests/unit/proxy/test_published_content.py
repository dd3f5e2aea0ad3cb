"""What a replica serves is what was published: a replica that (re)joins checks an adapter's files against the
fingerprint the ledger recorded at load before it loads them (sync.py), with the fakes of test_membership.

Files changed on disk after publish: that name is not loaded there, the replica serves the rest and is routed to only
for the rest, the alert metric counts it, a log line and GET /fleet say why; restored files or a republish (a new
fingerprint in the ledger) bring the name back. Every answer names the fingerprint its replica loaded the adapter with.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet_proxy import broadcast
from lorafleet_proxy.fleet import Fleet, State
from test_membership import R1, R2, Engine, check_and_sync, make_fleet, put


def publish(directory: Path, weights: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return fingerprint(directory)


def changed(fleet: Fleet) -> float | None:
    """The alert metric as Prometheus scrapes it."""
    return fleet.metrics.registry.get_sample_value("lorafleet_proxy_adapter_content_changed_total")


@pytest.fixture
async def fleet(tmp_path: Path) -> Fleet:
    engines = {R1: Engine(), R2: Engine()}
    fleet = make_fleet(engines, tmp_path)
    fleet.engines = engines  # type: ignore[attr-defined]
    yield fleet  # type: ignore[misc]
    await fleet.stop()


async def test_a_replica_that_joins_after_the_files_changed_withholds_that_name(
        fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engines: dict[str, Engine] = fleet.engines  # type: ignore[attr-defined]
    v1, v2 = tmp_path / "runs/r/.vllm_lora/trl-policy-v1", tmp_path / "runs/r/.vllm_lora/trl-policy-v2"
    published = publish(v1, b"published weights")
    put(fleet.ledger, "trl-policy-v1", str(v1), published)
    put(fleet.ledger, "trl-policy-v2", str(v2), publish(v2, b"v2"))
    await check_and_sync(fleet, R1)
    assert fleet.replicas[R1].adapters.keys() == {"trl-policy-v1", "trl-policy-v2"}

    altered = publish(v1, b"someone else's weights")  # same path, other content, no load through the proxy
    with caplog.at_level(logging.ERROR, logger="lorafleet.proxy.sync"):
        await check_and_sync(fleet, R2)
    late = fleet.replicas[R2]
    assert late.state is State.READY, late.last_error
    assert engines[R2].loads == ["trl-policy-v2"] and late.adapters == {"trl-policy-v2": str(v2)}
    assert fleet.replicas[R1].adapters.keys() == {"trl-policy-v1", "trl-policy-v2"}  # it loaded the published files
    assert changed(fleet) == 1
    why = late.as_json()["withheld"]["trl-policy-v1"]  # type: ignore[index]
    assert published in why and altered in why and "changed on disk after it was published" in why
    assert any("replica withholds adapter" in r.message and "trl-policy-v1" in r.message and published in r.message
               for r in caplog.records), caplog.text

    await fleet.check(late)  # the health round's reconcile: what it withholds is no reason to re-sync
    assert late.state is State.READY and engines[R2].loads == ["trl-policy-v2"]

    publish(v1, b"published weights")  # restored: the next catch-up loads it
    fleet.resync(late, "test")
    await late.sync_task  # type: ignore[misc]
    assert late.state is State.READY and late.adapters.keys() == {"trl-policy-v1", "trl-policy-v2"}
    assert late.as_json()["withheld"] == {} and changed(fleet) == 1


async def test_a_republish_under_the_same_name_is_loaded_everywhere(fleet: Fleet, tmp_path: Path) -> None:
    """The trainer reloading the name through the proxy records the new fingerprint (a rebind): nothing is withheld."""
    engines: dict[str, Engine] = fleet.engines  # type: ignore[attr-defined]
    v1 = tmp_path / "runs/r/.vllm_lora/trl-policy-v1"
    put(fleet.ledger, "trl-policy-v1", str(v1), publish(v1, b"first"))
    await check_and_sync(fleet, R1)
    republished = publish(v1, b"second")
    await check_and_sync(fleet, R2)
    assert "trl-policy-v1" in fleet.replicas[R2].withheld
    response = await broadcast.load_adapter(fleet, {"lora_name": "trl-policy-v1", "lora_path": str(v1)})
    assert response.status_code == 200, response.body
    assert fleet.ledger.get("trl-policy-v1").fingerprint == republished  # type: ignore[union-attr]
    for url in (R1, R2):
        replica = fleet.replicas[url]
        assert replica.state is State.READY and replica.withheld == {} and "trl-policy-v1" in replica.adapters
        assert replica.held["trl-policy-v1"].fingerprint == republished and "trl-policy-v1" in engines[url].adapters


async def test_unknown_fingerprints_are_loaded_as_before(fleet: Fleet, tmp_path: Path) -> None:
    """A ledger entry without a fingerprint (the proxy could not read the files at load) has nothing to compare."""
    v1 = tmp_path / "runs/r/.vllm_lora/trl-policy-v1"
    publish(v1, b"weights")
    put(fleet.ledger, "trl-policy-v1", str(v1), "")
    await check_and_sync(fleet, R1)
    assert fleet.replicas[R1].adapters.keys() == {"trl-policy-v1"} and not fleet.replicas[R1].withheld
