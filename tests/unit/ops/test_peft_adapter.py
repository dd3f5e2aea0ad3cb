"""The one adapter writer: the doctor's probe (rank 1, one q_proj, any model size) and the tiny model's
all-linear adapters, which PEFT itself must load with every tensor matched."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from lorafleet.settings import load_settings
from lorafleet_ops.commands.doctor.probe_adapter import publish_probe_adapter
from lorafleet_ops.peft_adapter import ALL_LINEAR, write_lora_adapter
from lorafleet_ops.tiny_model import make_adapter, make_tiny_model

QWEN_1_5B = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 28}


def _header(out: Path) -> tuple[dict, int, int]:
    blob = (out / "adapter_model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + size]), size, len(blob)


def test_probe_adapter_is_a_valid_minimal_lora_for_the_config(tmp_path):
    settings = load_settings(adapter_root=tmp_path, run_name="r")
    name, out = publish_probe_adapter(settings, QWEN_1_5B, "Qwen/Qwen2.5-Math-1.5B")
    assert out.name == name and out.parent == settings.adapter_root / "runs" / "r" / ".vllm_lora"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["target_modules"] == ["q_proj"] and adapter["r"] == 1
    header, size, length = _header(out)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert sorted(k for k in header if k != "__metadata__") == [f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"]
    assert header[f"{prefix}.lora_A.weight"]["shape"] == [1, 1536]
    assert header[f"{prefix}.lora_B.weight"]["shape"] == [1536, 1]
    assert length == 8 + size + 4 * (1536 + 1536) and (8 + size) % 8 == 0
    assert not list(out.parent.glob(".*.tmp")), "the staging directory must be gone"
    safetensors = pytest.importorskip("safetensors.numpy")
    tensors = safetensors.load_file(str(out / "adapter_model.safetensors"))
    assert tensors[f"{prefix}.lora_B.weight"].any(), "B must be non-zero"


def test_shapes_follow_head_dim_and_kv_heads(tmp_path):
    config = {"text_config": {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 64, "num_key_value_heads": 2,
                              "intermediate_size": 96, "num_hidden_layers": 1}}
    header, _, _ = _header(write_lora_adapter(tmp_path / "p", config, "m", rank=2))
    shapes = {key.split(".")[-3]: value["shape"] for key, value in header.items() if key.endswith("lora_B.weight")}
    assert shapes == {"q_proj": [256, 2], "k_proj": [128, 2], "v_proj": [128, 2], "o_proj": [128, 2],
                      "gate_proj": [96, 2], "up_proj": [96, 2], "down_proj": [128, 2]}


@pytest.mark.timeout(120)
def test_tiny_adapter_loads_in_peft_with_every_tensor_and_changes_the_output(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "tiny")
    out = make_adapter(tmp_path / "adapter", model_dir, rank=2, seed=3)
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 4
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        before = base(ids).logits
        policy = peft.PeftModel.from_pretrained(base, str(out)).eval()
        after = policy(ids).logits
    loaded = {name for name, _ in policy.named_parameters() if "lora_" in name}
    assert len(loaded) == 2 * len(ALL_LINEAR) * base.config.num_hidden_layers
    state = peft.get_peft_model_state_dict(policy)
    header, _, _ = _header(out)
    assert set(state) == set(header) - {"__metadata__"}, "PEFT's tensor names must be the writer's"
    assert (after - before).abs().max() > 1e-3, "the adapter must change the output"
