"""safetensors files compared as bytes agree with torch's comparison of the tensors they hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_trainer.safetensors_bytes import same_tensors
from safetensors.torch import save_file

pytestmark = pytest.mark.timeout(120)
VALUES = st.lists(st.floats(-4, 4, allow_nan=False, width=32).map(lambda v: v or 0.0), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(first=VALUES, second=VALUES, dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       metadata=st.sampled_from([None, {"format": "pt"}]))
def test_same_tensors_is_torchs_equality(tmp_path_factory, first, second, dtype, metadata):
    folder = tmp_path_factory.mktemp("st")
    a = {"lora_A.weight": torch.tensor(first, dtype=dtype), "lora_B.weight": torch.ones(2, dtype=dtype)}
    b = {"lora_B.weight": torch.ones(2, dtype=dtype), "lora_A.weight": torch.tensor(second, dtype=dtype)}
    save_file(a, str(folder / "a.safetensors"))
    save_file(b, str(folder / "b.safetensors"), metadata=metadata)
    expected = a["lora_A.weight"].shape == b["lora_A.weight"].shape and a["lora_A.weight"].equal(b["lora_A.weight"])
    assert same_tensors(folder / "a.safetensors", folder / "b.safetensors") == expected


def test_a_dtype_or_a_missing_tensor_differs(tmp_path):
    save_file({"w": torch.zeros(2, dtype=torch.float32)}, str(tmp_path / "f32.safetensors"))
    save_file({"w": torch.zeros(1, dtype=torch.float64)}, str(tmp_path / "f64.safetensors"))  # the same 8 bytes
    save_file({"w": torch.zeros(2), "x": torch.zeros(1)}, str(tmp_path / "more.safetensors"))
    assert not same_tensors(tmp_path / "f32.safetensors", tmp_path / "f64.safetensors")
    assert not same_tensors(tmp_path / "f32.safetensors", tmp_path / "more.safetensors")
    assert same_tensors(tmp_path / "f32.safetensors", tmp_path / "f32.safetensors")
