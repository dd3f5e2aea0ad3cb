"""What a replica attests about its LoRA adapters from inside its engine, as both sides read it.

The replica side is `lorafleet_vllm.lora_identity` (a vLLM worker extension), the judging side the proxy's
`attestation` module; neither imports the other, so the method name, the report's shape and the digest's
definition live here. The whole story: docs/concepts/provenance.md#attestation-what-the-engine-holds.

One report per worker (vLLM's `POST /collective_rpc` answers `{"results": [one per worker]}`):

    {"format": 1, "vllm": "0.31.0", "dtype": "torch.float32", "slots": [12, null, ...],
     "adapters": [{"name": "run--trl-policy-v3", "path": "/adapters/.content/<hex>", "id": 12,
                   "weights": "sha256:<hex>", "slot": 0, "slot_weights": "sha256:<hex>" | null,
                   "applied": ["model.layers.0.self_attn.q_proj", ...], "named": [...] | null}]}

`weights` hashes the registered adapter as the engine holds it (per module, after vLLM merged packed projections and
folded the scaling in); `slot_weights` hashes the rank-wide slice of the stacked LoRA tensors at the adapter's slot
(None when it sits in none); `applied` are the model's projections the adapter's weights reach, `named` those its
files name (None when its files cannot be read).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.safetensors_header import HeaderError, read_header

# The worker method vLLM's /collective_rpc calls; prefixed so it never collides with a vLLM worker attribute.
ATTEST_METHOD = "lorafleet_lora_identity"
# The class `vllm serve --worker-extension-cls` names (the replica's command sets it).
EXTENSION_CLASS = "lorafleet_vllm.lora_identity.LoraIdentity"
REPORT_FORMAT = 1
DIGEST_PREFIX = "sha256:"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def attest_request(names: list[str] | None = None) -> dict[str, Any]:
    """The /collective_rpc body asking for a report: of every adapter the engine holds, or only of `names` (vLLM passes
    only string kwargs, so they travel as one JSON list). A load needs only its own adapter's digests, and every
    digest is a pass over the adapter's tensors inside the engine's loop, between two decode steps."""
    body: dict[str, Any] = {"method": ATTEST_METHOD}
    if names is not None:
        body["kwargs"] = {"names": json.dumps(sorted(names))}
    return body


def requested_names(names: str) -> set[str] | None:
    """The names a report was asked for (`attest_request`'s kwarg; "": every adapter)."""
    return set(json.loads(names)) if names else None


class ReportError(ValueError):
    """A /collective_rpc answer that is not an attestation report of this format."""


@dataclass(frozen=True)
class AdapterIdentity:
    """One adapter as one worker holds it."""

    name: str
    path: str
    weights: str
    slot_weights: str | None
    applied: tuple[str, ...]
    named: tuple[str, ...] | None

    @property
    def shortfall(self) -> int:
        """How many fewer projections the engine applies than the files name (vLLM applying 0 modules: all of them).
        Counted, not matched by name: a model whose vLLM class renames its modules still applies as many."""
        return 0 if self.named is None else max(len(self.named) - len(set(self.applied)), 0)


@dataclass(frozen=True)
class Report:
    """One replica's attestation: its group (vLLM version and LoRA dtype: digests compare only within one) and its
    adapters by name (the newest registration of each name: vLLM's cache may keep an older one until evicted)."""

    vllm: str
    dtype: str
    adapters: dict[str, AdapterIdentity]

    @property
    def group(self) -> str:
        return f"vllm {self.vllm} {self.dtype}"


def parse_report(answer: Any) -> Report:
    """The report of a `/collective_rpc` answer; with several workers (tensor parallelism) they must agree on every
    digest's presence and their digests are combined per adapter (each worker holds its shard)."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or not results:
        raise ReportError(f"no worker results in {str(answer)[:200]!r}")
    reports = [_one(result) for result in results]
    first = reports[0]
    if len(reports) == 1:
        return first
    adapters: dict[str, AdapterIdentity] = {}
    for name, identity in first.adapters.items():
        shards = [report.adapters.get(name) for report in reports]
        if any(shard is None for shard in shards):
            raise ReportError(f"adapter {name!r} is registered on some workers only")
        adapters[name] = AdapterIdentity(
            name, identity.path, combine([s.weights for s in shards if s]),
            None if any(s is None or s.slot_weights is None for s in shards)
            else combine([s.slot_weights for s in shards if s and s.slot_weights]),
            identity.applied, identity.named)
    return Report(first.vllm, first.dtype, adapters)


def _one(result: Any) -> Report:
    if not isinstance(result, dict) or result.get("format") != REPORT_FORMAT:
        raise ReportError(f"not an attestation report of format {REPORT_FORMAT}: {str(result)[:200]!r}")
    try:
        newest: dict[str, tuple[int, AdapterIdentity]] = {}
        for item in result["adapters"]:
            named = item.get("named")
            identity = AdapterIdentity(str(item["name"]), str(item["path"]), str(item["weights"]),
                                       item.get("slot_weights"), tuple(item["applied"]),
                                       None if named is None else tuple(named))
            if identity.name not in newest or item["id"] > newest[identity.name][0]:
                newest[identity.name] = (int(item["id"]), identity)
        return Report(str(result["vllm"]), str(result["dtype"]), {k: v for k, (_, v) in newest.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"malformed attestation report: {exc!r}") from exc


def combine(digests: list[str]) -> str:
    """One digest for a list of digests (a tensor-parallel adapter's shards, in worker order)."""
    return DIGEST_PREFIX + hashlib.sha256("\n".join(digests).encode()).hexdigest()


def named_modules(adapter_dir: str | Path) -> tuple[str, ...] | None:
    """The modules an adapter's safetensors file names (PEFT's prefix and LoRA suffixes cut), sorted; read from the
    file's header alone (no tensor is read). None when there is no such file or its header is unreadable."""
    try:
        fd = os.open(Path(adapter_dir) / WEIGHTS_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        header = read_header(fd).entries
    except (OSError, HeaderError):
        return None
    finally:
        os.close(fd)
    modules = set()
    for key in header:
        for suffix in LORA_SUFFIXES:
            if key.endswith(suffix):
                modules.add(key.removeprefix(PEFT_PREFIX).removesuffix(suffix))
    return tuple(sorted(modules))
