"""Which vLLM a replica runs and whether the fleet can use it, read from the replica itself at admission.

The fleet relies on vLLM features that are not all there in every version nor in every configuration: the dev
routes (/pause, /resume, /is_paused, /reset_prefix_cache, /server_info) mount only with VLLM_SERVER_DEV_MODE=1, the
runtime LoRA routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, and /v1/completions takes `return_token_ids` only
in recent versions. Each replica's version comes from GET /version and what it mounted from GET /openapi.json
(FastAPI's document of its routes and request bodies), so a replica that lacks a feature is refused with a message
naming its version, the feature and the setting that brings it, instead of failing later in a broadcast.

The supported range is SUPPORTED: its oldest end is tested by `make test-compat VLLM=0.26.0` (a venv of its own,
pinned in constraints.txt), its newest is the images' pin, tested by `make test`. docs/reference/vllm-compat.md says
what differs between them and why none of it changes what the fleet sends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from lorafleet.vllm_api import VLLMClient, VLLMError

log = logging.getLogger("lorafleet.vllm_compat")

# (oldest, newest) vLLM release the fleet is tested with. Older is refused; newer is admitted with a warning when it
# has every feature below (the features, not the number, decide: a newer vLLM may drop a route).
SUPPORTED = ("0.26.0", "0.31.0")

Route = tuple[str, str]  # (METHOD, path) as the OpenAPI document lists it


@dataclass(frozen=True)
class Feature:
    """Routes the fleet calls, and how a replica gets them."""

    name: str
    routes: tuple[Route, ...]
    remedy: str


FEATURES = (
    Feature("the OpenAI-compatible server",
            (("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"), ("POST", "/v1/completions")),
            f"serve it with `vllm serve` (vLLM {SUPPORTED[0]} or newer)"),
    Feature("the dev routes",
            (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
             ("GET", "/server_info")),
            "start it with VLLM_SERVER_DEV_MODE=1 (lorafleet-replica sets it)"),
    Feature("the runtime LoRA routes",
            (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")),
            "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (lorafleet-replica sets it)"),
)
# Fields of /v1/completions' body that the canary and the trainer send and read back (token ids, not text).
COMPLETION_FIELDS = ("return_token_ids", "ignore_eos", "logprobs", "seed")

# PEP 440 versions (packaging): a pre-release or dev build sorts before its release; a local part (`+cpu`) and a
# post-release sort after it, so `0.26.0+cpu` is the oldest end.
OLDEST, NEWEST = (Version(end) for end in SUPPORTED)


def standing(version: str) -> str | None:
    """Where a reported version stands against the range: "unknown" (not a version), "older", "newer", or None
    (inside it). The one judgement both admission and the doctor use."""
    try:
        release = Version(version)
    except InvalidVersion:
        return "unknown"
    if release < OLDEST:
        return "older"
    return "newer" if Version(release.base_version) > NEWEST else None


@dataclass(frozen=True)
class Capabilities:
    """What one replica's vLLM is and offers: its version as reported, its routes and completion body fields.

    `routes` is None when it publishes no OpenAPI document; `completion_fields` is None when the document does
    not describe the completion body (a hand-made server).
    """

    version: str
    routes: frozenset[Route] | None
    completion_fields: frozenset[str] | None

    @classmethod
    def parse(cls, version: str, document: dict[str, Any] | None) -> Capabilities:
        if document is None:
            return cls(version, None, None)
        paths = document.get("paths") or {}
        routes = frozenset((method.upper(), path) for path, operations in paths.items()
                           for method in operations or {})
        return cls(version, routes, _body_fields(document, "/v1/completions"))

    def refusal(self) -> str | None:
        """Why the fleet cannot use this replica (its version, what it lacks, what brings it), or None."""
        named = f"vLLM {self.version}"
        if self.routes is None:
            return (f"refused: {named} publishes no /openapi.json, from which the fleet reads the routes it "
                    "mounted: drop --disable-fastapi-docs from its command")
        problems = []
        for feature in FEATURES:
            missing = [f"{method} {path}" for method, path in feature.routes if (method, path) not in self.routes]
            if missing:
                problems.append(f"{named} lacks {feature.name} ({', '.join(missing)}): {feature.remedy}")
        fields = [name for name in COMPLETION_FIELDS
                  if self.completion_fields is not None and name not in self.completion_fields]
        if fields:
            problems.append(f"{named}'s /v1/completions does not take {', '.join(fields)}, which the canary and "
                            f"the trainer send: use vLLM {OLDEST} or newer")
        where = standing(self.version)
        if where == "unknown":
            problems.append(f"{named}: the version is not understood; supported: {_range()}")
        elif where == "older":
            problems.append(f"{named} is older than the oldest supported ({_range()}): upgrade it")
        return "refused: " + "; ".join(problems) if problems else None

    def untested(self) -> str | None:
        """A warning for a vLLM newer than the newest tested one (it has every feature the fleet uses), or None."""
        if standing(self.version) == "newer":
            return f"vLLM {self.version} is newer than the newest tested ({_range()}); it has every route in use"
        return None


class Incompatible(VLLMError):
    """A replica the fleet cannot use: the message names its version, the missing feature and the setting."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, "Incompatible")
        self.args = (message,)  # read as what it says, not as an HTTP status


async def admission(client: VLLMClient) -> Capabilities:
    """Read a replica's version and routes; raise Incompatible with the refusal when the fleet cannot use it."""
    try:
        version = await client.version()
    except VLLMError as exc:
        if exc.status != 404:
            raise
        raise Incompatible(f"refused: GET /version answered 404: not a vLLM server, or one older than "
                           f"{OLDEST}") from exc
    try:
        document: dict[str, Any] | None = await client.openapi()
    except VLLMError as exc:
        if exc.status != 404:
            raise
        document = None
    capabilities = Capabilities.parse(version, document)
    refusal = capabilities.refusal()
    if refusal is not None:
        raise Incompatible(refusal)
    warning = capabilities.untested()
    if warning is not None:
        log.warning("%s at %s", warning, client.base_url)
    return capabilities


def _range() -> str:
    return f"{SUPPORTED[0]} to {SUPPORTED[1]}"


def _body_fields(document: dict[str, Any], path: str) -> frozenset[str] | None:
    """The JSON body properties of POST `path` (following one $ref), or None when the document does not say."""
    try:
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        if "$ref" in schema:
            schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
        return frozenset(schema["properties"])
    except (KeyError, TypeError, AttributeError):
        return None
