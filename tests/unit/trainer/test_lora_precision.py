"""LoRA layers under bf16 autocast without PEFT's float32 input copies: same function, float32 adapter gradients."""

from __future__ import annotations

import copy

import torch
from lorafleet_trainer.lora_precision import autocast_adapter_inputs
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(32, 64)
        self.down_proj = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


def lora_block(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(Block().to(torch.bfloat16), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: make the adapter's path count
            torch.nn.init.normal_(parameter, std=0.5)
    return model


def run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, autocast:
        out = model(x)
        out.float().pow(2).mean().backward()
    activations = ([len(x), 32], [len(x), 64])  # the two layers' inputs; the weights' casts are not counted
    float32_copies = sum(1 for event in prof.events() if event.name == "aten::_to_copy"
                         and event.input_shapes and event.input_shapes[0] in activations)
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return out, grads, float32_copies


def test_the_adapter_path_computes_the_same_without_the_input_copies() -> None:
    for seed in range(3):
        casting = lora_block(seed)
        lean = copy.deepcopy(casting)
        assert autocast_adapter_inputs(lean) == 2
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        out_cast, grads_cast, copies_cast = run(casting, x)
        out_lean, grads_lean, copies_lean = run(lean, x)
        assert copies_cast >= copies_lean + 4  # PEFT's float32 copy of each input and its cast back are gone
        assert torch.allclose(out_cast.float(), out_lean.float(), rtol=2e-2, atol=2e-2)
        assert grads_lean.keys() == grads_cast.keys() and grads_lean
        for name, grad in grads_lean.items():
            assert grad.dtype == torch.float32, name  # the adapter still trains in float32
            reference = grads_cast[name]
            assert (grad - reference).norm() <= 3e-2 * reference.norm() + 1e-6, name
