"""The trainer benchmark's pieces on CPU: the published shape, the length draw, the vLLM stand-in, the profile
buckets (the kept result, bench/results/bench-trainer.json, is rendered on docs/benchmarks/trainer.md)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trainer_bench import _category
from trainer_shape import PUBLISHED_LENGTHS, QWEN25_MATH_1_5B, qwen2_config
from vllm_standin import StandIn

ROOT = Path(__file__).resolve().parents[3]

# Qwen/Qwen2.5-Math-1.5B's config.json, architecture fields as published (seen in the bf16 conversion
# https://huggingface.co/mlx-community/Qwen2.5-Math-1.5B-bf16/blob/c4eab3af176f2821f3e0f8c16aa73f9bd1e6043c/config.json).
PUBLISHED_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rope_theta": 10000, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "tie_word_embeddings": True, "use_sliding_window": False, "max_window_layers": 21, "sliding_window": 4096,
}


def test_the_benchmark_model_has_the_published_architecture():
    for key, value in QWEN25_MATH_1_5B.items():
        assert PUBLISHED_CONFIG[key] == value, key
    config = qwen2_config(QWEN25_MATH_1_5B, eos_token_id=0, pad_token_id=3)
    built = config.to_dict()
    rope_theta = (built.get("rope_parameters") or {}).get("rope_theta", built.get("rope_theta"))
    assert rope_theta == PUBLISHED_CONFIG["rope_theta"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                "use_sliding_window"):
        assert built[key] == PUBLISHED_CONFIG[key], key
    assert config.hidden_size // config.num_attention_heads == 128  # head dim, as FA-style kernels need


@given(seed=st.integers(0, 2**32), cap=st.integers(1, 5000))
def test_completion_lengths_stay_within_the_cap(seed, cap):
    length = PUBLISHED_LENGTHS.draw(random.Random(seed), cap)
    assert min(PUBLISHED_LENGTHS.minimum, cap) <= length <= cap


def test_completion_lengths_pack_like_the_published_run():
    rng = random.Random(0)
    lengths = [PUBLISHED_LENGTHS.draw(rng, 3000) for _ in range(20_000)]
    mean = sum(lengths) / len(lengths)
    # 12.7 samples per 16,384-token row, rows 95% full, prompts shared by the 8 rollouts of a group.
    assert 16384 * 0.95 / 14.5 < mean < 16384 * 0.95 / 11
    assert 0 < sum(length == 3000 for length in lengths) / len(lengths) < 0.1  # some hit max_tokens


async def _exchange(model_dir: Path) -> list[tuple[int, dict]]:
    from aiohttp.test_utils import TestClient, TestServer

    adapter = model_dir / "v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    standin = StandIn(model="base", token_ids=100, eos=0, model_vocab=151936, max_model_len=4096, max_lora_rank=1,
                      max_loras=6, lengths=PUBLISHED_LENGTHS)
    calls = [
        ("get", "/server_info", None),
        ("post", "/v1/completions", {"model": "trl-policy-v1", "prompt": [1, 2], "max_tokens": 8}),
        ("post", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": str(model_dir / "missing")}),
        ("post", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": str(adapter)}),
        ("post", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": str(adapter)}),
        ("post", "/v1/completions", {"model": "trl-policy-v1", "prompt": [1, 2], "max_tokens": 3000, "seed": 5}),
        ("post", "/v1/completions", {"model": "base", "prompt": [1], "max_tokens": 4, "seed": 1}),
        ("post", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}),
        ("post", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}),
    ]
    answers = []
    async with TestClient(TestServer(standin.app())) as client:
        for method, path, body in calls:
            response = await getattr(client, method)(path, json=body) if body else await getattr(client, method)(path)
            text = await response.text()
            answers.append((response.status, json.loads(text) if text.startswith("{") else {"text": text}))
    return answers


def test_the_standin_answers_as_vllm_does(tmp_path):
    info, unknown, missing, loaded, again, completion, capped, unloaded, gone = asyncio.run(_exchange(tmp_path))
    assert info[0] == 200 and info[1]["vllm_config"]["lora_config"]["max_loras"] == 6
    assert info[1]["vllm_config"]["parallel_config"]["data_parallel_size"] == 1
    assert unknown[0] == 404 and missing[0] == 404 and again[0] == 400 and gone[0] == 404  # vLLM's statuses
    assert loaded[0] == 200 and unloaded[0] == 200
    choice = completion[1]["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == completion[1]["usage"][
        "completion_tokens"]
    assert all(4 <= token < 100 for token in choice["token_ids"][:-1])
    assert (choice["finish_reason"], choice["token_ids"][-1]) in (("stop", 0), ("length", choice["token_ids"][-1]))
    assert capped[1]["choices"][0]["finish_reason"] == "length" and len(capped[1]["choices"][0]["token_ids"]) == 4


def _event(name, shapes=(), parents=(), kernels=()):
    parent = None
    for parent_name in reversed(parents):
        parent = SimpleNamespace(name=parent_name, cpu_parent=parent)
    return SimpleNamespace(name=name, input_shapes=[list(shape) for shape in shapes], cpu_parent=parent,
                           kernels=[SimpleNamespace(name=kernel) for kernel in kernels])


@pytest.mark.parametrize(("event", "bucket"), [
    (_event("aten::mm", [(16384, 1536), (1536, 1)]), "lora_matmul"),
    (_event("aten::mm", [(1, 16384), (16384, 8960)], ["autograd::engine::evaluate_function: MmBackward0"]),
     "lora_matmul"),
    (_event("aten::mm", [(16384, 1536), (1536, 8960)]), "base_and_head_matmul"),
    (_event("aten::linear", [(1, 16384, 1536), (4608, 1536)]), "base_and_head_matmul"),
    (_event("aten::_foreach_mul_", [(1, 1536)], ["Optimizer.step#AdamW.step"]), "optimizer"),
    (_event("aten::_flash_attention_backward"), "attention"),
    (_event("aten::copy_", [(16384, 1536), (16384, 1536)]), "data_movement"),
    (_event("cuLaunchKernelEx", kernels=["_forward_kernel"]), "other"),
    (_event("aten::mul", [(16384, 8960), (16384, 8960)]), "other"),
])
def test_profile_buckets(event, bucket):
    assert _category(event, rank=1) == bucket


async def _fleet_view() -> dict:
    from aiohttp.test_utils import TestClient, TestServer

    standin = StandIn(model="base", token_ids=100, eos=0, model_vocab=151936, max_model_len=4096, max_lora_rank=1,
                      max_loras=6, lengths=PUBLISHED_LENGTHS)
    async with TestClient(TestServer(standin.app())) as client:
        response = await client.get("/fleet")
        assert response.status == 200
        return {"fleet": await response.json(), "host": f"http://{client.host}:{client.port}"}


def test_the_standin_describes_itself_as_a_one_replica_fleet_the_doctor_can_read():
    from lorafleet_ops.commands.doctor.fleet_checks import check_fleet
    from lorafleet_ops.commands.doctor.model import ReplicaView, Snapshot, Status

    seen = asyncio.run(_fleet_view())
    (replica,) = seen["fleet"]["replicas"]
    assert replica["url"] == seen["host"] and replica["state"] == "ready" and replica["generates"] is True
    view = ReplicaView(replica["url"], replica["state"], replica["last_error"], proxy_generates=replica["generates"])
    assert check_fleet(Snapshot(fleet_url=seen["host"], replicas=[view])).status is Status.PASS


def test_the_launcher_table_is_printed_from_the_kept_result():
    from launcher_bench import table

    kept = json.loads((ROOT / "bench" / "results" / "bench-launcher.json").read_text())
    printed = table(kept)
    assert "world_size=1 sharding=fsdp2" in printed and kept["gpu"] in printed
    assert "2-GPU comparison has not been run" in printed
