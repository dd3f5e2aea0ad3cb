"""The replica's digests (lorafleet_vllm.lora_identity) over stand-ins shaped like vLLM 0.31's LoRA state: exact (one
changed element, a renamed module or an absent projection changes them), and a slot holding exactly the registered
weights hashes like them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet.engine_identity import ATTEST_METHOD, attest_request, requested_names
from lorafleet_vllm.lora_identity import TAG, applied_projections, report, slot_digest, weights_digest

pytestmark = pytest.mark.timeout(120)


def adapter(rank: int, seed: int, names: tuple[str, ...] = ("m.a_proj", "m.b_proj")) -> Any:
    generator = torch.Generator().manual_seed(seed)
    loras = {name: SimpleNamespace(lora_a=torch.randn(rank, 8, generator=generator),
                                   lora_b=torch.randn(6, rank, generator=generator)) for name in names}
    return SimpleNamespace(loras=loras, rank=rank)


def manager_holding(model: Any, slots: int, slot: int, max_rank: int) -> Any:
    """A manager whose layers' stacked tensors hold `model` at `slot` (as vLLM's set_lora copies it)."""
    modules = {}
    for name, weights in model.loras.items():
        a, b = torch.zeros(slots, 1, max_rank, 8), torch.zeros(slots, 1, 6, max_rank)
        a[slot, 0, : model.rank] = weights.lora_a
        b[slot, 0, :, : model.rank] = weights.lora_b
        modules[name] = SimpleNamespace(lora_a_stacked=(a,), lora_b_stacked=(b,))
    return SimpleNamespace(modules=modules, packed_modules={},
                           _get_lora_layer_weights=lambda model, name: model.loras.get(name))


@settings(max_examples=25, deadline=None)
@given(rank=st.integers(1, 8), seed=st.integers(0, 1000), slot=st.integers(0, 3))
def test_the_digest_is_exact_and_a_faithful_slot_hashes_like_the_registered_weights(rank: int, seed: int,
                                                                                    slot: int) -> None:
    model = adapter(rank, seed)
    assert weights_digest(model) == weights_digest(adapter(rank, seed))
    manager = manager_holding(model, slots=4, slot=slot, max_rank=8)
    assert slot_digest(manager, slot, rank) == weights_digest(model)
    changed = adapter(rank, seed)
    changed.loras["m.b_proj"].lora_b[0, 0] += 1e-6
    assert weights_digest(changed) != weights_digest(model)
    manager.modules["m.a_proj"].lora_b_stacked[0][slot, 0, 0, 0] += 1e-6  # the slot overwritten in place
    assert slot_digest(manager, slot, rank) != weights_digest(model)


def test_renamed_modules_apply_nothing_and_an_absent_projection_is_hashed_and_not_applied() -> None:
    model = adapter(2, 0)
    manager = manager_holding(model, slots=2, slot=0, max_rank=4)
    assert applied_projections(manager, model) == ["m.a_proj", "m.b_proj"]
    renamed = adapter(2, 0, ("x.a_proj", "x.b_proj"))
    assert applied_projections(manager, renamed) == []
    assert weights_digest(renamed) != weights_digest(model)
    packed = SimpleNamespace(loras={"m.qk_proj": SimpleNamespace(lora_a=[torch.ones(2, 8), None],
                                                                  lora_b=[torch.ones(6, 2), None])}, rank=2)
    manager.packed_modules = {"m.qk_proj": ["m.q_proj", "m.k_proj"]}
    manager.modules = {"m.qk_proj": manager.modules["m.a_proj"]}
    assert applied_projections(manager, packed) == ["m.q_proj"]
    whole = SimpleNamespace(loras={"m.qk_proj": SimpleNamespace(lora_a=[torch.ones(2, 8), torch.ones(2, 8)],
                                                                 lora_b=[torch.ones(6, 2), torch.ones(6, 2)])}, rank=2)
    assert weights_digest(whole) != weights_digest(packed)


def test_a_report_asked_for_some_names_holds_exactly_those_and_every_slot() -> None:
    """A load's attestation asks for its adapter only (engine_identity.attest_request): the report digests that one,
    not every adapter the engine holds, and still lists which id each slot holds."""
    models = {lora_id: adapter(2, lora_id) for lora_id in (3, 5, 7)}
    for lora_id, model in models.items():
        setattr(model, TAG, (f"run--v{lora_id}", f"/store/{lora_id}"))
    manager = manager_holding(models[5], slots=4, slot=1, max_rank=4)
    manager.list_adapters = lambda: models
    manager.lora_index_to_id = [None, 5, None, None]
    asked = attest_request(["run--v5", "run--v7"])
    assert asked["method"] == ATTEST_METHOD
    names = requested_names(asked["kwargs"]["names"])
    partial = report(manager, "0.31.0", "torch.float32", names)
    assert [entry["name"] for entry in partial["adapters"]] == ["run--v5", "run--v7"]
    assert partial["slots"] == [None, 5, None, None]
    assert partial["adapters"][0]["weights"] == weights_digest(models[5]) == partial["adapters"][0]["slot_weights"]
    assert "kwargs" not in attest_request() and requested_names("") is None
    every = report(manager, "0.31.0", "torch.float32", requested_names(""))
    assert [entry["name"] for entry in every["adapters"]] == ["run--v3", "run--v5", "run--v7"]
