"""The isolation harness's own parts (tests/support/lorafleet_testing/isolation), without replicas: the checker
finds each kind of violation in artifacts written by hand and none in clean ones; each planted defect, put back,
really lets a victim's bytes into the content store where the product refuses them (so the harness has something to
catch); the schedule is the seed's alone and draws every trick.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet_proxy.content_store import ContentError, ContentStore
from lorafleet_testing.fakes import weights_file
from lorafleet_testing.isolation.adversary import KINDS, digests, schedule
from lorafleet_testing.isolation.checker import check
from lorafleet_testing.isolation.plants import PLANTS, put_back
from lorafleet_testing.isolation.tricks import Scene, plan

pytestmark = pytest.mark.timeout(60)


def publish(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 1}')
    (folder / "adapter_model.safetensors").write_bytes(weights_file(weights))
    return folder


def artifacts(folder: Path, attempts: list[dict[str, Any]], observations: list[dict[str, Any]],
              victim_status: int = 200) -> Path:
    victim = publish(folder / "v", b"victim weights")
    mine = publish(folder / "m", b"my weights")
    (folder / "victims.json").write_text(json.dumps({
        "adversary": "mallory", "adversary_files": digests(mine),
        "victims": {"alice": {"name": "alice--v1", "fingerprint": fingerprint(victim), "files": digests(victim)}}}))
    for name, rows in (("attempts", attempts), ("observations", observations),
                       ("victim_loads", [{"attempt": 0, "run": "alice", "status": victim_status, "body": ""}])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "ledger.json").write_text(json.dumps({"adapters": [
        {"name": "alice--v1", "run": "alice", "path": str(victim), "fingerprint": fingerprint(victim)}]}))
    return folder


def refusal(path: str, message: str, status: int = 400) -> dict[str, Any]:
    body = {"error": {"message": message, "type": "InvalidUserInput", "param": "lora_path", "code": status}}
    return {"attempt": 1, "trick": "swap-version", "name": "m1", "path": path, "status": status,
            "body": json.dumps(body)}


def test_clean_artifacts_hold_no_violation(tmp_path: Path) -> None:
    folder = artifacts(tmp_path, [refusal("runs/mallory/.vllm_lora/m1", "adapter path runs/mallory/.vllm_lora/m1: "
                                          "… is not a plain folder (a symlink or a file): refused")], [])
    mine = digests(tmp_path / "m")
    (tmp_path / "observations.jsonl").write_text(json.dumps(
        {"attempt": 1, "replica": "r1", "name": "mallory--m1", "root": "x", "files": mine}) + "\n")
    verdict = check(folder)
    assert verdict["violations"] == [] and verdict["refusals_by_reason"] == {"symlink or file in the path": 1}


def test_each_violation_is_found(tmp_path: Path) -> None:
    victim_files = json.loads(json.dumps(digests(publish(tmp_path / "v", b"victim weights"))))
    folder = artifacts(tmp_path, [refusal("runs/mallory/.vllm_lora/m1", "something went wrong")],
                       [{"attempt": 1, "replica": "r1", "name": "mallory--m1", "root": "x", "files": victim_files},
                        {"attempt": 1, "replica": "r2", "name": "alice--v1", "root": "y", "files": {}}], 500)
    found = {violation["invariant"] for violation in check(folder)["violations"]}
    assert found == {"refusal-named", "victim-bytes", "victim-undisturbed"}


@pytest.mark.parametrize("plant", PLANTS)
def test_each_plant_lets_a_victims_bytes_in_where_the_product_refuses_them(tmp_path: Path, plant: str) -> None:
    victim = publish(tmp_path / "runs/alice/.vllm_lora/trl-policy-v1", b"alice's weights")
    template = publish(tmp_path / "runs/mallory/template", b"mallory's weights")
    scene = Scene(tmp_path, "mallory", template, {"alice": victim}, 1 << 20, tmp_path / ".content")
    trick = "store-leftover" if plant == "reuse-unverified" else "symlink-version"
    attempt = plan(trick, scene, random.Random(1), 1)

    def stored_files() -> set[str]:
        stored = ContentStore(tmp_path / ".content", tmp_path).ingest(attempt.path)
        return set(digests(stored.path).values())

    theirs = set(digests(victim).values()) - set(digests(template).values())
    if plant == "reuse-unverified":
        assert not stored_files() & theirs
        attempt = plan(trick, scene, random.Random(2), 2)  # another content's torn folder, for the planted run
    else:
        with pytest.raises(ContentError, match="not a plain folder"):
            stored_files()
    undo = put_back(plant)
    try:
        assert stored_files() & theirs, f"{plant} let nothing through: the harness could not catch it"
    finally:
        undo()


def test_the_schedule_is_the_seeds_alone_and_draws_every_trick() -> None:
    def first(seed: int) -> list[tuple[int, str, int]]:
        drawn = itertools.islice(schedule(seed), 600)
        return [(number, trick, rng.getrandbits(32)) for number, trick, rng in drawn]

    assert first(64) == first(64) != first(65)
    assert {trick for _, trick, _ in first(64)} == set(KINDS)
