"""What a replica serves is what was published: the proxy copies an adapter into its content store at load, and every
replica, one that joins later included, loads the store's folder (sync.py), with the fakes of test_membership.

A trainer's later change to its own folder reaches no replica; a republish through the proxy is a new content under
the name (a rebind). Every answer names the fingerprint its replica loaded the adapter with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet_proxy import broadcast
from lorafleet_proxy.fleet import Fleet, State
from test_membership import R1, R2, Engine, check_and_sync, make_fleet, publish


@pytest.fixture
async def fleet(tmp_path: Path) -> Fleet:
    engines = {R1: Engine(), R2: Engine()}
    fleet = make_fleet(engines, tmp_path)
    fleet.engines = engines  # type: ignore[attr-defined]
    yield fleet  # type: ignore[misc]
    await fleet.stop()


async def test_the_trainers_later_change_to_its_folder_reaches_no_replica(fleet: Fleet, tmp_path: Path) -> None:
    engines: dict[str, Engine] = fleet.engines  # type: ignore[attr-defined]
    v1 = publish(tmp_path / "runs/r/.vllm_lora/trl-policy-v1", b"published weights")
    published = fingerprint(v1)
    await check_and_sync(fleet, R1)
    response = await broadcast.load_adapter(fleet, fleet.ledger.content,
                                            {"lora_name": "trl-policy-v1", "lora_path": str(v1)})
    assert response.status_code == 200, response.body
    entry = fleet.ledger.get("trl-policy-v1")
    assert entry is not None and entry.fingerprint == published and entry.source == str(v1)
    assert entry.path == str(tmp_path / ".content" / published.removeprefix("sha256:"))

    publish(v1, b"someone else's weights")  # the trainer writes its folder after the publish
    await check_and_sync(fleet, R2)  # a replica that joins later
    late = fleet.replicas[R2]
    assert late.state is State.READY, late.last_error
    for engine in engines.values():
        assert engine.adapters == {"trl-policy-v1": entry.path}, "a replica was sent a path the trainer can change"
        assert fingerprint(engine.adapters["trl-policy-v1"]) == published
    assert fingerprint(v1) != published


async def test_a_republish_under_the_same_name_is_a_rebind_to_the_new_content(fleet: Fleet, tmp_path: Path) -> None:
    """The trainer reloading the name through the proxy: a new store folder, loaded everywhere (a rebind)."""
    engines: dict[str, Engine] = fleet.engines  # type: ignore[attr-defined]
    for url in (R1, R2):
        await check_and_sync(fleet, url)
    v1 = tmp_path / "runs/r/.vllm_lora/trl-policy-v1"
    body = {"lora_name": "trl-policy-v1", "lora_path": str(v1)}
    publish(v1, b"first")
    assert (await broadcast.load_adapter(fleet, fleet.ledger.content, body)).status_code == 200
    first = fleet.ledger.get("trl-policy-v1")
    republished = fingerprint(publish(v1, b"second"))
    response = await broadcast.load_adapter(fleet, fleet.ledger.content, body)
    assert response.status_code == 200, response.body
    entry = fleet.ledger.get("trl-policy-v1")
    assert entry is not None and first is not None and entry.fingerprint == republished and entry.path != first.path
    for url in (R1, R2):
        replica = fleet.replicas[url]
        assert replica.state is State.READY and replica.held["trl-policy-v1"].fingerprint == republished
        assert engines[url].adapters["trl-policy-v1"] == entry.path


@pytest.mark.parametrize("where", [".content", ".fleet", ".content/00", ".fleet/proxy-ledger.json"])
async def test_a_load_naming_the_proxys_own_folders_is_refused(fleet: Fleet, tmp_path: Path, where: str) -> None:
    """Nobody but the proxy names a store path: 400 in vLLM's body, before any replica is asked."""
    engines: dict[str, Engine] = fleet.engines  # type: ignore[attr-defined]
    await check_and_sync(fleet, R1)
    (tmp_path / ".content").mkdir(exist_ok=True)
    response = await broadcast.load_adapter(fleet, fleet.ledger.content,
                                            {"lora_name": "x", "lora_path": str(tmp_path / where)})
    assert response.status_code == 400
    assert b"only the proxy names those" in response.body and b'"param":"lora_path"' in response.body
    assert "/v1/load_lora_adapter" not in engines[R1].calls
