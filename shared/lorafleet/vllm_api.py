"""A typed async client for the vLLM endpoints lorafleet uses (runtime LoRA, dev mode, /server_info); the same on
every supported vLLM, 0.26 to 0.31 (lorafleet.vllm_compat checks a replica has them).

Errors keep vLLM's own status and message, so callers (the proxy above all) can relay them
unchanged or act on them: "No adapter found" is a lagging volume, "has already been loaded" is
a name collision, 404 on unload is "not loaded".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

PauseMode = Literal["abort", "wait", "keep"]
# Set by lorafleet's proxy on every routed answer: the base URL of the replica that answered.
PROXY_UPSTREAM_HEADER = "X-Proxy-Upstream"
# Set on every generation answer (docs/concepts/provenance.md): the weights asked for, by fleet name, and for an
# adapter the fingerprint of the content the answering replica loaded under that name. The trainer reads both.
PROXY_ADAPTER_HEADER = "X-Lorafleet-Adapter"
PROXY_FINGERPRINT_HEADER = "X-Lorafleet-Fingerprint"
# Also on a generation answer, once the answering replica's engine attested the adapter (lorafleet.engine_identity):
# the digest of the weights it held under that name at its last attestation, and that attestation's age in seconds.
PROXY_ATTESTED_HEADER = "X-Lorafleet-Attested"
PROXY_ATTESTED_AGE_HEADER = "X-Lorafleet-Attested-Age"
# vLLM's HTTP server (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), counted from when it
# sent its answer. A client that keeps an idle connection as long (httpx's default expiry is 5 s too, counted from
# when it read the answer) can send a request on it just as the server closes it: the request fails with a reset
# (httpx.ReadError). Rare (none in 560 reuses at 5 s idle in a trial), but never needed: the clients that leave
# connections to a replica idle between uses (the proxy's pools, the canary benches' probes, the test relay) let them
# go sooner.
REPLICA_KEEPALIVE_EXPIRY_S = 2.0


def replica_limits(**limits: int | None) -> httpx.Limits:
    """httpx limits for a client of a vLLM replica: `limits` (max_connections, max_keepalive_connections, unbounded
    when not given), idle connections let go before the replica closes them."""
    return httpx.Limits(**limits, keepalive_expiry=REPLICA_KEEPALIVE_EXPIRY_S)


class VLLMError(Exception):
    """A non-2xx answer from vLLM (or the proxy), keeping its status, message and error type."""

    def __init__(self, status: int, message: str, error_type: str = "", body: str = "") -> None:
        super().__init__(f"{status} {error_type}: {message}" if error_type else f"{status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type
        self.body = body

    @property
    def adapter_not_found(self) -> bool:
        """The load failed because the adapter directory is not visible (yet): a lagging volume."""
        return self.status == 404 and "No adapter found" in self.message

    @property
    def already_loaded(self) -> bool:
        return self.status == 400 and "has already been loaded" in self.message


class VLLMUnreachable(VLLMError):
    """No HTTP answer at all: connection refused, reset or timed out."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, "ConnectionError")


def error_from_response(status: int, text: str) -> VLLMError:
    """Map a vLLM error body to VLLMError: `{"error": {"message", "type", ...}}`, the dev routes'
    `{"error": "<text>"}` (a failed /pause), FastAPI's `detail`, or plain text."""
    message, error_type = text, ""
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", text))
            error_type = str(err.get("type", ""))
        elif isinstance(err, str):
            message = err
        elif isinstance(payload.get("detail"), str):
            message = payload["detail"]
        elif "message" in payload:
            message = str(payload["message"])
            error_type = str(payload.get("type", ""))
    return VLLMError(status, message, error_type, text)


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's JSON error shape, for answers the proxy produces itself."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class LoraConfig:
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int | None = None


@dataclass(frozen=True)
class ServerInfo:
    """The parts of `/server_info?config_format=json` lorafleet reads; `raw` keeps the rest."""

    model: str
    lora: LoraConfig | None
    data_parallel_size: int
    block_size: int | None
    dtype: str | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def parse(cls, payload: dict[str, Any]) -> ServerInfo:
        config = payload.get("vllm_config") or {}
        if not isinstance(config, dict):
            raise ValueError("server_info was not requested with config_format=json")
        lora = config.get("lora_config")
        model_config = config.get("model_config") or {}
        cache = config.get("cache_config") or {}
        parallel = config.get("parallel_config") or {}
        return cls(
            model=str(model_config.get("model", "")),
            lora=(
                LoraConfig(int(lora["max_lora_rank"]), int(lora["max_loras"]), lora.get("max_cpu_loras"))
                if isinstance(lora, dict)
                else None
            ),
            data_parallel_size=int(parallel.get("data_parallel_size", 1)),
            block_size=cache.get("block_size"),
            dtype=model_config.get("dtype"),
            raw=payload,
        )


@dataclass(frozen=True)
class ModelCard:
    id: str
    root: str | None
    parent: str | None
    max_model_len: int | None


class VLLMClient:
    """Async client for one vLLM server (or the lorafleet proxy, which speaks the same API)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str = "",
        timeout: float | httpx.Timeout = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout)
        self._headers = headers

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def request(
        self, method: str, path: str, *, json_body: Any = None, params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request; raise VLLMUnreachable without an answer and VLLMError on non-2xx."""
        kwargs: dict[str, Any] = {"headers": self._headers, "params": params}
        if json_body is not None:
            kwargs["json"] = json_body
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self._client.request(method, self.base_url + path, **kwargs)
        except httpx.TransportError as exc:
            raise VLLMUnreachable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise error_from_response(response.status_code, response.text)
        return response

    # --- plain endpoints ---------------------------------------------------------------------
    async def health(self, timeout: float = 5.0) -> bool:
        """True when /health answers 200; False on any error or no answer."""
        try:
            await self.request("GET", "/health", timeout=timeout)
        except VLLMError:
            return False
        return True

    async def version(self) -> str:
        """`/version`: the vLLM version string, e.g. "0.31.0" or "0.26.0+cpu"."""
        return str((await self.request("GET", "/version")).json()["version"])

    async def openapi(self) -> dict[str, Any]:
        """`/openapi.json`: FastAPI's document of the routes this server mounted (lorafleet.vllm_compat reads it)."""
        document = (await self.request("GET", "/openapi.json")).json()
        if not isinstance(document, dict):
            raise ValueError("/openapi.json is not a JSON object")
        return document

    async def server_info(self) -> ServerInfo:
        response = await self.request("GET", "/server_info", params={"config_format": "json"})
        return ServerInfo.parse(response.json())

    async def models(self) -> list[ModelCard]:
        """`/v1/models`: the base model first, then the loaded adapters (root = adapter path)."""
        data = (await self.request("GET", "/v1/models")).json().get("data", [])
        return [
            ModelCard(item["id"], item.get("root"), item.get("parent"), item.get("max_model_len")) for item in data
        ]

    async def loaded_adapters(self) -> dict[str, str]:
        """Adapter name -> path for every LoRA adapter the server has registered."""
        return {card.id: card.root or "" for card in await self.models() if card.parent is not None}

    async def completions(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return (await self.request("POST", "/v1/completions", json_body=body, timeout=timeout)).json()

    async def tokenize(self, prompt: str) -> list[int]:
        return (await self.request("POST", "/tokenize", json_body={"prompt": prompt})).json()["tokens"]

    async def metrics(self) -> str:
        return (await self.request("GET", "/metrics")).text

    # --- runtime LoRA ------------------------------------------------------------------------
    async def load_lora_adapter(
        self, name: str, path: str, *, load_inplace: bool = False, timeout: float = 600.0
    ) -> str:
        body = {"lora_name": name, "lora_path": path, "load_inplace": load_inplace}
        return (await self.request("POST", "/v1/load_lora_adapter", json_body=body, timeout=timeout)).text

    async def unload_lora_adapter(self, name: str) -> str:
        return (await self.request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})).text

    # --- dev-mode endpoints ------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.request("POST", "/pause", params={"mode": mode}, timeout=1800.0)

    async def resume(self) -> None:
        await self.request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self.request("GET", "/is_paused")).json().get("is_paused"))

    async def reset_prefix_cache(self) -> None:
        await self.request("POST", "/reset_prefix_cache")


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name` in Prometheus text whose labels include `labels` (all label sets by default); a
    histogram's `_sum`/`_count`/`_bucket` samples are found under their family too."""
    families = {name.removesuffix("_total")} | {name.removesuffix(suffix) for suffix in ("_sum", "_count", "_bucket")}
    return sum(
        sample.value
        for metric in text_string_to_metric_families(text)
        if metric.name in families
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
