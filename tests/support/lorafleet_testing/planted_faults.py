"""Faults planted into a real vLLM replica's engine from outside, for the attestation tests (never in an image).

The test replicas name `PlantedFaults` as their `--worker-extension-cls` (process_tier.py's `replica_env`): it is the
product's extension (lorafleet_vllm.lora_identity.LoraIdentity) plus methods a test calls directly on one replica
through `POST /collective_rpc` (args are strings, as vLLM passes them). Each reproduces a reported failure in the
engine's own state, where nothing outside the engine can see it:
- `lorafleet_test_rename_modules`: the registered adapter's module names no longer match the model (vllm#34186: vLLM
  applies 0 modules and serves the base model);
- `lorafleet_test_overwrite_slot`: one LoRA layer's stacked tensors at the adapter's slot overwritten in place;
- `lorafleet_test_point_slot`: the slot mapping pointed at another adapter (vllm#47724: a request decodes with
  another tenant's adapter);
- `lorafleet_test_drop_projection`: one projection of a packed module gone (unsloth-zoo#941);
- `lorafleet_test_mark` / `lorafleet_test_marks`: a call that leaves a mark, to prove the proxy never relays
  /collective_rpc.
"""

from __future__ import annotations

from typing import Any

from lorafleet_vllm.lora_identity import TAG, LoraIdentity, as_list

MARKS: list[str] = []


def manager_of(worker: Any) -> Any:
    return worker.model_runner.lora_manager._adapter_manager


def newest(manager: Any, name: str) -> tuple[int, Any]:
    """(id, LoRAModel) of the newest registration of `name` (an older one may linger in vLLM's cache)."""
    found = [(lora_id, model) for lora_id, model in manager.list_adapters().items()
             if getattr(model, TAG, ("",))[0] == name]
    if not found:
        raise KeyError(f"{name!r} is not registered in this worker")
    return max(found, key=lambda item: item[0])


class PlantedFaults(LoraIdentity):
    """The product's extension and the test's faults."""

    def lorafleet_test_rename_modules(self, name: str) -> int:
        _, model = newest(manager_of(self), name)
        model.loras = {"model.language_model." + key.removeprefix("model."): value
                       for key, value in model.loras.items()}
        return len(model.loras)

    def lorafleet_test_overwrite_slot(self, name: str) -> int:
        manager = manager_of(self)
        lora_id, _ = newest(manager, name)
        slot = manager.lora_index_to_id.index(lora_id)
        layer = manager.modules[sorted(manager.modules)[0]]
        as_list(layer.lora_b_stacked)[0][slot].add_(1.0)
        return slot

    def lorafleet_test_point_slot(self, name: str, other: str) -> list[int]:
        manager = manager_of(self)
        mine, theirs = newest(manager, name)[0], newest(manager, other)[0]
        slots = manager.lora_index_to_id
        first, second = slots.index(mine), slots.index(theirs)
        slots[first], slots[second] = theirs, mine
        return [first, second]

    def lorafleet_test_drop_projection(self, name: str) -> str:
        manager = manager_of(self)
        _, model = newest(manager, name)
        module = next(key for key, value in sorted(model.loras.items()) if isinstance(value.lora_a, list))
        weights = model.loras[module]
        weights.lora_a[-1] = None
        weights.lora_b[-1] = None
        return module

    def lorafleet_test_mark(self) -> int:
        MARKS.append("called")
        return len(MARKS)

    def lorafleet_test_marks(self) -> int:
        return len(MARKS)
