"""Typed requests of the proxy's admin endpoints (their 400 for anything that does not fit: `errors.validation_error`).

The models mirror the fields vLLM 0.31 accepts (vllm/entrypoints/serve/lora/protocol.py, the dev
routers' query parameters), so a client that works against one vLLM server works against the proxy.
They are checked by FastAPI before a handler runs: a `lora_path` that is a list, a number or a
dict, a bad adapter name or an unknown pause mode is a 400 in vLLM's error body, before any
broadcast takes the fleet lock or sends anything to a replica.

The generation bodies are described here for the OpenAPI document only (what routing reads:
model, prompt or messages, stream; every other field passes through to vLLM untouched).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from lorafleet.adapters import ADAPTER_NAME_PATTERN
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

# Token ids are int64 in vLLM; a larger one can only be a client bug.
MAX_TOKEN_ID = 2**63 - 1

# The pattern is in the schema (OpenAPI, fuzzing), and pydantic's `$` is the end of the string, newline or not.
AdapterName = Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN.pattern)]
PauseMode = Literal["abort", "wait", "keep"]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM 0.31 reads it; unknown fields are ignored, as vLLM does."""

    lora_name: AdapterName = Field(description="Adapter name: letters, digits, '.', '_', '-' (at most 128).")
    lora_path: str = Field(min_length=1, description="Adapter directory; must resolve inside the run's folder "
                           "ADAPTER_ROOT/runs/<run>/ (a fleet without run keys: the default run anywhere in "
                           "ADAPTER_ROOT).")
    load_inplace: StrictBool = Field(False, description="Refused when true: load new weights under a new name.")
    is_3d_lora_weight: Literal[False] = Field(False, description="Not supported by the fleet proxy.")


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter; `lora_int_id` is accepted and ignored, as in vLLM 0.31."""

    lora_name: AdapterName
    lora_int_id: int | None = None


class RegisterRunRequest(BaseModel):
    """POST /runs/<run>/register (lorafleet's own): the run's slot reservation and fair-share weight."""

    max_staleness: int = Field(ge=0, le=1024, description="The trainer's MAX_STALENESS: it reserves this + 2 slots.")
    weight: float = Field(1.0, gt=0, le=1e6, description="Fair-share weight: generation throughput in proportion.")


class RatioReportRequest(BaseModel):
    """POST /ratio_report (lorafleet's own): a trainer's evidence that one replica decodes one of the run's adapters
    with other weights than its peers (its importance ratio departs: docs/concepts/provenance.md)."""

    replica: str = Field(min_length=1, max_length=2048, description="The replica's URL, as X-Proxy-Upstream names it.")
    lora_name: AdapterName = Field(description="The run's adapter the replica departs on, by the run's own name.")
    evidence: str = Field(min_length=1, max_length=4096, description="What the trainer measured (logged as given).")


class ResetPrefixCacheQuery(BaseModel):
    """Query of POST /reset_prefix_cache (vLLM 0.31's dev route)."""

    reset_running_requests: bool = False
    reset_external: bool = False

    def params(self) -> dict[str, str]:
        """The query as sent to every replica: only the known flags, spelled as vLLM parses them."""
        return {name: str(value).lower() for name, value in self.model_dump().items()}


# --- generation bodies: documentation of what routing reads, validated on the hot path --------------
Prompt = str | list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | list[str]


class CompletionRequest(BaseModel):
    """POST /v1/completions: routing reads model, prompt and stream; other fields go to vLLM as sent."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The base model or a loaded adapter's name.")
    prompt: Prompt = Field(description="Text, token ids (0 <= id < 2**63), or a list of texts.")
    stream: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: routing reads model, messages and stream."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False


GENERATION_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
