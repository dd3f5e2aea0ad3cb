"""The run key (TRAINER_RUN_KEY_FILE) reaches the fleet on every client the trainer has: lorafleet's own VLLMClient,
TRL's control calls and TRL's rollout child. Each is checked against a real HTTP server that records what it got."""

from __future__ import annotations

import collections
import http.server
import importlib
import json
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from lorafleet.settings import ConfigError, StackSettings, load_settings
from lorafleet_trainer import fleet_preflight
from lorafleet_trainer.fleet_preflight import fleet_size, prepare_fleet
from lorafleet_trainer.main import main
from lorafleet_trainer.proxy_client import ProxyClient
from lorafleet_trainer.resilience import retry_control_calls, retrying_session
from lorafleet_trainer.run_key_file import read_run_key
from peft import LoraConfig

KEY = "lfr_test-key_0123456789"
RUN = "/runs/alpha"
WITH_AND_WITHOUT_KEY = pytest.mark.parametrize(("key", "expected"), [(KEY, f"Bearer {KEY}"), ("", None)])


@dataclass(frozen=True)
class Seen:
    method: str
    path: str  # without the query
    authorization: str | None


@dataclass
class RecordingServer:
    """A local HTTP server answering JSON from `answers` (path -> body, else {}) and recording each request."""

    url: str
    answers: dict[str, Any]
    seen: list[Seen] = field(default_factory=list)

    def authorizations(self) -> set[str | None]:
        return {request.authorization for request in self.seen}


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    recording = RecordingServer(url="", answers={})

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            recording.seen.append(Seen(self.command, path, self.headers.get("Authorization")))
            body = json.dumps(recording.answers.get(path, {})).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    recording.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield recording
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No setting leaks in from the environment or a .env file (as in test_config)."""
    for name in StackSettings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ADAPTER_ROOT", str(tmp_path / "adapters"))


# --- reading the key ---------------------------------------------------------------------------------------------

def key_settings(path: Path | str) -> StackSettings:
    return load_settings(trainer_run_key_file=str(path))


def test_the_key_is_the_files_content_without_whitespace(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(f"  {KEY}\n")
    assert read_run_key(key_settings(tmp_path / "key")) == KEY


def test_no_key_file_means_no_key() -> None:
    assert read_run_key(key_settings("")) == ""


@pytest.mark.parametrize("content", [None, b" \n", b"\xff\xfe\x00"], ids=["missing", "empty", "binary"])
def test_a_missing_empty_or_binary_key_file_is_a_config_error_naming_the_variable(tmp_path: Path,
                                                                                  content: bytes | None) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"^TRAINER_RUN_KEY_FILE\b") as refused:
        read_run_key(key_settings(path))
    assert str(path) in str(refused.value)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("content", [None, ""])
def test_the_trainer_exits_2_on_a_bad_key_file_before_asking_the_fleet(
    server: RecordingServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    content: str | None,
) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("TRAINER_RUN_KEY_FILE", str(path))
    monkeypatch.setenv("TRAINER_VLLM_URL", server.url + RUN)
    assert main([]) == 2
    assert "TRAINER_RUN_KEY_FILE" in capsys.readouterr().err
    assert server.seen == []


@pytest.mark.usefixtures("clean_env")
def test_a_dry_run_logs_which_key_file_is_used_but_never_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    monkeypatch.setenv("TRAINER_RUN_KEY_FILE", str(tmp_path / "key"))
    assert main(["--dry-run", "--replicas", "1"]) == 0
    err = capsys.readouterr().err
    assert any("event=run_key_used" in line and str(tmp_path / "key") in line for line in err.splitlines())
    assert KEY not in err


# --- (a) lorafleet's VLLMClient (fleet_preflight.py) -------------------------------------------------------------

@WITH_AND_WITHOUT_KEY
async def test_fleet_size_sends_the_run_key(server: RecordingServer, key: str, expected: str | None) -> None:
    server.answers[f"{RUN}/fleet"] = {"replicas": [{"url": "a", "state": "ready"}, {"url": "b", "state": "ready"}]}
    settings = load_settings(trainer_vllm_url=server.url + RUN, trainer_replicas=0)
    assert await fleet_size(settings, run_key=key) == 2
    assert [request.path for request in server.seen] == [f"{RUN}/health", f"{RUN}/fleet"]
    assert server.authorizations() == {expected}


@WITH_AND_WITHOUT_KEY
async def test_every_preparing_call_sends_the_run_key(server: RecordingServer, monkeypatch: pytest.MonkeyPatch,
                                                      key: str, expected: str | None) -> None:
    async def no_doctor(settings: StackSettings, lora_config: Any) -> None:  # it reads the key file itself (its tests)
        pass

    monkeypatch.setattr(fleet_preflight, "doctor_preflight", no_doctor)
    server.answers.update({
        f"{RUN}/register": {"slots": 6, "budget": {"capacity": 12}},
        f"{RUN}/server_info": {"vllm_config": {
            "lora_config": {"max_lora_rank": 8, "max_loras": 6, "max_cpu_loras": 6},
            "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
            "model_config": {"model": "/models/tiny", "dtype": "torch.float32"},
        }},
        f"{RUN}/v1/models": {"data": [{"id": "base", "root": "/models/tiny", "parent": None},
                                      {"id": "trl-policy-v3", "root": "/adapters/v3", "parent": "base"}]},
    })  # fmt: skip
    settings = load_settings(trainer_vllm_url=server.url + RUN)
    lora = LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM")
    await prepare_fleet(settings, lora, run_key=key)
    assert {request.path for request in server.seen} >= {
        f"{RUN}/register", f"{RUN}/server_info", f"{RUN}/v1/models", f"{RUN}/v1/unload_lora_adapter",
    }
    assert server.authorizations() == {expected}


# --- (b) TRL's control calls (resilience.py) ---------------------------------------------------------------------

def test_trls_vllm_client_talks_http_only_through_its_modules_requests_get_and_post() -> None:
    """The shim replaces `requests.get/post` of TRL's module: a TRL that used anything else would bypass the key."""
    import inspect

    from trl.experimental.async_grpo import vllm_client

    used = set(re.findall(r"\brequests\.(\w+)", inspect.getsource(vllm_client)))
    assert used == {"get", "post", "ConnectionError", "Timeout"}


@WITH_AND_WITHOUT_KEY
def test_trls_control_calls_send_the_run_key(server: RecordingServer, monkeypatch: pytest.MonkeyPatch, key: str,
                                             expected: str | None) -> None:
    from trl.experimental.async_grpo import vllm_client

    monkeypatch.setattr(vllm_client, "requests", vllm_client.requests)  # restored after the test
    retry_control_calls(retrying_session(connect_retries=0), proxy=ProxyClient(server.url + RUN, key))
    server.answers[f"{RUN}/server_info"] = {"vllm_config": {"model_config": {"dtype": "torch.float32"}}}
    client = vllm_client.VLLMClient(server.url + RUN, server_timeout=5)
    client.wait_for_server_ready()
    assert client.get_dtype() == "torch.float32"
    client.pause()
    client.load_lora_adapter("trl-policy-v1", "/adapters/v1")
    client.resume()
    client.unload_lora_adapter("trl-policy-v0")
    assert [(request.method, request.path) for request in server.seen] == [
        ("GET", f"{RUN}/health"), ("GET", f"{RUN}/server_info"), ("POST", f"{RUN}/pause"),
        ("POST", f"{RUN}/v1/load_lora_adapter"), ("POST", f"{RUN}/resume"), ("POST", f"{RUN}/v1/unload_lora_adapter"),
    ]
    assert server.authorizations() == {expected}


# --- (c) TRL's rollout child (fleet_rollouts.py) -----------------------------------------------------------------

class _Tokenizer:
    """Enough of a tokenizer for TRL's loop to be built (a response template: no schema is looked up)."""

    response_template = "{{ content }}"


def _constant_reward(**kwargs: Any) -> list[float]:
    return [0.0] * len(kwargs["completions"])


async def _post_one_completion(self: Any, stop_event: Any) -> None:
    """Stands in for TRL's generate loop: one completion through TRL's own `_post` on the loop's session."""
    await self._post("/v1/completions", {"model": self._request_model, "prompt": [1, 2, 3]}, 5)


async def _no_scoring(self: Any, stop_event: Any) -> None:
    pass


class _InlineChild:
    """`mp.Process` for AsyncRolloutWorker.start(): runs the child's target in a thread of this process, after a
    pickle round trip of (loop_cls, loop_kwargs) as spawn makes one (its queues stay as they are)."""

    unpickled_loop_cls: type | None = None

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str, daemon: bool) -> None:
        self._target, self._args = target, args
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._popen = None  # nothing to join in stop()

    def start(self) -> None:
        loop_cls, loop_kwargs = pickle.loads(pickle.dumps(self._args[:2]))
        _InlineChild.unpickled_loop_cls = loop_cls
        child = threading.Thread(target=self._target, args=(loop_cls, loop_kwargs, *self._args[2:]))
        child.start()
        child.join(timeout=60)

    def is_alive(self) -> bool:
        return False


def rollout_worker(url: str) -> Any:
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    return AsyncRolloutWorker(
        model_name="tiny", dataset=[{"prompt": [{"role": "user", "content": "1+1?"}]}],
        reward_funcs=[_constant_reward], processing_class=_Tokenizer(), eos_token_ids=[0], vllm_server_url=url,
        max_inflight_tasks=1, num_generations=2, request_timeout=5,
    )  # fmt: skip


def trainer_with(worker: Any) -> SimpleNamespace:
    return SimpleNamespace(rollout_worker=worker, accelerator=SimpleNamespace(is_main_process=True))


@WITH_AND_WITHOUT_KEY
def test_the_rollout_child_sends_the_run_key(server: RecordingServer, monkeypatch: pytest.MonkeyPatch, key: str,
                                             expected: str | None) -> None:
    """TRL's own start() and _child_main() (in a thread instead of a spawned process), its _run_loops session and
    _post: only the generate and score loops are stand-ins."""
    from lorafleet_trainer.fleet_rollouts import FleetRolloutLoop, wire_rollouts
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    monkeypatch.setattr(trl_worker._AsyncRolloutLoop, "_generate_loop", _post_one_completion)
    monkeypatch.setattr(trl_worker._AsyncRolloutLoop, "_score_loop", _no_scoring)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the child's env scrub stays in this test
    worker = rollout_worker(server.url + RUN)
    wire_rollouts(trainer_with(worker), key, load_settings())
    worker._mp_ctx = SimpleNamespace(Process=_InlineChild)
    try:
        worker.start()
    finally:
        worker.stop()
    assert not worker._failed_event.is_set()
    assert _InlineChild.unpickled_loop_cls is FleetRolloutLoop
    assert server.seen == [Seen("POST", f"{RUN}/v1/completions", expected)]


def test_the_keyed_loop_is_what_spawn_can_import_and_carries_the_key_in_its_kwargs(server: RecordingServer) -> None:
    """Spawn pickles the loop class by module and name; the key rides in the kwargs the child builds the loop from."""
    from lorafleet_trainer.fleet_rollouts import FleetRolloutLoop, wire_rollouts

    worker = rollout_worker(server.url + RUN)
    wire_rollouts(trainer_with(worker), KEY, load_settings())
    module = importlib.import_module("lorafleet_trainer.fleet_rollouts")
    assert worker._loop_cls is FleetRolloutLoop is getattr(module, FleetRolloutLoop.__qualname__)
    assert worker._loop_kwargs["run_key"] == KEY


def test_without_a_key_the_rollout_loop_adds_no_header_but_still_waits_for_the_fleet(server: RecordingServer) -> None:
    from lorafleet_trainer.fleet_rollouts import FleetRolloutLoop, wire_rollouts

    worker = rollout_worker(server.url + RUN)
    wire_rollouts(trainer_with(worker), "", load_settings(trainer_fleet_wait_s=42.0))
    assert worker._loop_cls is FleetRolloutLoop
    assert worker._loop_kwargs["run_key"] == "" and worker._loop_kwargs["fleet_wait_s"] == 42.0


def test_a_worker_the_key_cannot_reach_refuses_loudly(server: RecordingServer) -> None:
    from lorafleet_trainer.fleet_rollouts import RolloutsUnsupported, wire_rollouts

    with pytest.raises(RolloutsUnsupported, match="not TRL's AsyncRolloutWorker"):
        wire_rollouts(trainer_with(SimpleNamespace(_loop_cls=object, _loop_kwargs={})), KEY, load_settings())
    with pytest.raises(RolloutsUnsupported, match="rank 0 has no rollout worker"):
        wire_rollouts(trainer_with(None), KEY, load_settings())
    started = rollout_worker(server.url + RUN)
    started._process = object()
    with pytest.raises(RolloutsUnsupported, match="started before it was wired"):
        wire_rollouts(trainer_with(started), KEY, load_settings())


def test_a_trl_without_the_hooks_is_a_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet_trainer.fleet_rollouts import check_rollout_hooks
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    check_rollout_hooks()  # TRL 1.16, as installed
    monkeypatch.delattr(trl_worker.AsyncRolloutWorker, "_loop_cls")
    missing = r"^TRAINER_RUN_KEY_FILE / TRAINER_FLEET_WAIT_S: .* lacks AsyncRolloutWorker\._loop_cls"
    with pytest.raises(ConfigError, match=missing):
        check_rollout_hooks()


async def test_a_refused_key_ends_the_wait_for_the_fleet_at_once() -> None:
    """A 401/403 from the fleet is an answer, not an outage: the trainer says so at once instead of waiting."""
    from lorafleet.vllm_api import VLLMClient, error_body
    from lorafleet_trainer.fleet_preflight import PreflightError, wait_healthy

    calls: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(401, json=error_body("run 'b' needs its run key", "Unauthorized", 401))

    http = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    async with VLLMClient("http://fleet:8000/runs/b", client=http) as client:
        with pytest.raises(PreflightError, match=r"answered 401: run 'b' needs its run key .*TRAINER_RUN_KEY_FILE"):
            await wait_healthy(client, timeout_s=60)
    assert len(calls) == 1


# --- the rollouts' wait for the fleet (TRAINER_FLEET_WAIT_S) -------------------------------------------------------


def waiting_loop(wait_s: float, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A FleetRolloutLoop with only what `_retry` uses (TRL's own __init__ needs a dataset and a tokenizer)."""
    from lorafleet_trainer import fleet_rollouts

    monkeypatch.setattr(fleet_rollouts, "RETRY_MAX_S", 0.01)
    loop = fleet_rollouts.FleetRolloutLoop.__new__(fleet_rollouts.FleetRolloutLoop)
    loop._fleet_wait_s = wait_s
    loop._counters = collections.defaultdict(float)
    return loop


def answered(status: int) -> BaseException:
    """What aiohttp's raise_for_status raises for `status`."""
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://proxy:8000/v1/completions")
    info = aiohttp.RequestInfo(url, "POST", CIMultiDictProxy(CIMultiDict()), url)
    return aiohttp.ClientResponseError(info, (), status=status, message="from the proxy")


def failing(failures: list[BaseException]) -> Callable[[], Any]:
    async def attempt() -> str:
        if failures:
            raise failures.pop(0)
        return "answer"

    return attempt


async def test_a_completion_waits_for_the_fleet_and_goes_on_when_it_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiohttp
    from lorafleet_trainer.fleet_rollouts import COMPLETIONS_LABEL

    loop = waiting_loop(30.0, monkeypatch)
    unavailable = answered(503)
    outage = [aiohttp.ClientConnectionError("refused")] * 40 + [unavailable, TimeoutError()]
    assert await loop._retry(failing(list(outage)), label=COMPLETIONS_LABEL, max_attempts=30) == "answer"
    assert loop._counters["rollout/vllm_retry_total"] == len(outage)  # beyond TRL's 30 attempts


async def test_a_refusal_is_final_and_the_wait_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiohttp
    from lorafleet_trainer.fleet_rollouts import COMPLETIONS_LABEL

    loop = waiting_loop(30.0, monkeypatch)
    refused = answered(401)
    with pytest.raises(aiohttp.ClientResponseError):
        await loop._retry(failing([refused]), label=COMPLETIONS_LABEL)
    assert loop._counters["rollout/vllm_retry_total"] == 0
    loop = waiting_loop(0.2, monkeypatch)
    started = time.monotonic()
    with pytest.raises(aiohttp.ClientConnectionError):
        await loop._retry(failing([aiohttp.ClientConnectionError("refused")] * 10_000), label=COMPLETIONS_LABEL)
    assert time.monotonic() - started < 10  # gave up once TRAINER_FLEET_WAIT_S had passed
    with pytest.raises(aiohttp.ClientConnectionError):  # TRL's inner quick attempts are one try: the outer one waits
        await loop._retry(failing([aiohttp.ClientConnectionError("refused")]), label="POST /v1/completions",
                          max_attempts=3)
