"""Attention backends on CPU: the built-in kernel's argument mapping, the refusals, and TRAINER_ATTENTION's choice.

torch's varlen FlashAttention runs only on CUDA, so here it is replaced by a stand-in with the same
signature (the newer one with window_size/enable_gqa, or the older one with is_causal only) that
computes with the pure-PyTorch kernel; the real kernel is compared on a GPU in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from attention_bench import grpo_tree
from lorafleet_trainer.attention import (
    UnsupportedAttention,
    builtin_varlen_func,
    choose_backend,
    hub_kernel,
    torch_varlen_func,
)

TOL = 1e-2  # bf16 values, float32 arithmetic in both paths


def new_api(calls: list[dict[str, Any]]) -> Callable[..., torch.Tensor]:
    """torch >= 2.11's signature: window_size (left, right) aligned bottom-right, enable_gqa."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        calls.append({"heads_k": key.shape[1], "window_size": window_size, "enable_gqa": enable_gqa, "scale": scale,
                      "max": (max_q, max_k), "cu_dtype": cu_seq_q.dtype})
        assert enable_gqa or key.shape[1] == query.shape[1]
        return torch_varlen_func(query, key, value, cu_seq_q, cu_seq_k, softmax_scale=scale, window_size=window_size)

    return varlen_attn


def old_api(calls: list[dict[str, Any]]) -> Callable[..., torch.Tensor]:
    """torch 2.10's signature: is_causal only, no GQA."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False,
                    scale=None):
        calls.append({"heads_k": key.shape[1], "is_causal": is_causal})
        assert key.shape[1] == query.shape[1], "this kernel has no GQA"
        return torch_varlen_func(query, key, value, cu_seq_q, cu_seq_k, softmax_scale=scale, causal=is_causal)

    return varlen_attn


def inputs(heads_q: int = 4, heads_k: int = 2) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q = torch.randn(13, heads_q, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 19, heads_k, 8, dtype=torch.bfloat16).unbind(0)
    return q, k, v, torch.tensor([0, 6, 13]), torch.tensor([0, 9, 19])


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["causal", "sliding"])
def test_new_api_gets_flash_attention_window_and_gqa_unchanged(window: tuple[int, int]) -> None:
    q, k, v, cu_q, cu_k = inputs()
    calls: list[dict[str, Any]] = []
    out = builtin_varlen_func(q, k, v, cu_q, cu_k, softmax_scale=0.3, causal=True, window_size=window,
                              kernel=new_api(calls))
    assert calls == [{"heads_k": 2, "window_size": (window[0], 0), "enable_gqa": True, "scale": 0.3, "max": (7, 10),
                      "cu_dtype": torch.int32}]
    expected = torch_varlen_func(q, k, v, cu_q, cu_k, softmax_scale=0.3, causal=True, window_size=window)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)


def test_old_api_gets_is_causal_and_repeated_key_value_heads() -> None:
    q, k, v, cu_q, cu_k = inputs()
    calls: list[dict[str, Any]] = []
    out = builtin_varlen_func(q, k, v, cu_q, cu_k, 7, 10, causal=True, kernel=old_api(calls))
    assert calls == [{"heads_k": 4, "is_causal": True}]
    torch.testing.assert_close(out, torch_varlen_func(q, k, v, cu_q, cu_k, causal=True), atol=TOL, rtol=0)


def test_old_api_refuses_a_sliding_window_instead_of_ignoring_it() -> None:
    q, k, v, cu_q, cu_k = inputs()
    with pytest.raises(UnsupportedAttention, match=r"no window_size .*\(3, 0\)"):
        builtin_varlen_func(q, k, v, cu_q, cu_k, causal=True, window_size=(3, 0), kernel=old_api([]))


@pytest.mark.parametrize(
    ("options", "message"),
    [({"softcap": 30.0}, "softcap"), ({"dropout_p": 0.1}, "dropout_p"), ({"alibi_slopes": torch.ones(4)}, "alibi"),
     ({"unknown_flag": True}, "unknown_flag")],
)
def test_arguments_the_kernel_cannot_honour_are_refused(options: dict[str, Any], message: str) -> None:
    q, k, v, cu_q, cu_k = inputs()
    with pytest.raises(UnsupportedAttention, match=message):
        builtin_varlen_func(q, k, v, cu_q, cu_k, causal=True, kernel=new_api([]), **options)


def test_neutral_flash_attention_defaults_pass() -> None:
    q, k, v, cu_q, cu_k = inputs()
    builtin_varlen_func(q, k, v, cu_q, cu_k, causal=True, dropout_p=0.0, return_attn_probs=False, kernel=new_api([]))


def test_float32_and_non_grouping_heads_are_refused() -> None:
    q, k, v, cu_q, cu_k = inputs()
    with pytest.raises(UnsupportedAttention, match="float16/bfloat16"):
        builtin_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True, kernel=new_api([]))
    q3, k2, v2, _, _ = inputs(heads_q=3, heads_k=2)
    with pytest.raises(UnsupportedAttention, match="multiple of key/value heads"):
        builtin_varlen_func(q3, k2, v2, cu_q, cu_k, causal=True, kernel=new_api([]))


def test_cpu_tensors_are_refused_by_the_real_kernel() -> None:
    q, k, v, cu_q, cu_k = inputs()
    with pytest.raises(UnsupportedAttention, match=r"CUDA|no torch\.nn\.attention"):
        builtin_varlen_func(q, k, v, cu_q, cu_k, causal=True)


# --- TRAINER_ATTENTION -------------------------------------------------------------------------------------------


def unreachable_hub() -> None:
    raise OSError("Cannot reach https://huggingface.co: offline")


def unexpected_fetch() -> None:
    raise AssertionError("the Hub must not be asked")


def test_auto_on_gpu_takes_the_hub_kernel_when_it_loads() -> None:
    assert choose_backend("auto", cuda=True, fetch_hub=lambda: object(), builtin=lambda: print).backend == "fa3"


def test_auto_on_gpu_falls_back_to_builtin_when_the_fetch_fails_and_says_why() -> None:
    choice = choose_backend("auto", cuda=True, fetch_hub=unreachable_hub, builtin=lambda: print)
    assert choice.backend == "builtin"
    assert "OSError: Cannot reach https://huggingface.co: offline" in choice.reason


def test_auto_on_gpu_falls_back_through_trls_real_lookup() -> None:
    """TRL's own `_flash_attn()` fails here (no `kernels` package / no Hub): the real failure path, not a stub."""
    with pytest.raises(Exception):  # noqa: B017 - whatever the environment raises, it must raise
        hub_kernel()
    assert choose_backend("auto", cuda=True, builtin=lambda: print).backend == "builtin"


def test_auto_falls_back_to_the_torch_kernel_when_torch_has_no_builtin() -> None:
    choice = choose_backend("auto", cuda=True, fetch_hub=unreachable_hub, builtin=lambda: None)
    assert choice.backend == "torch"
    assert "slow on GPU" in choice.reason


def test_auto_on_cpu_is_the_torch_kernel_without_asking_the_hub() -> None:
    assert choose_backend("auto", cuda=False, fetch_hub=unexpected_fetch).backend == "torch"


def test_forced_backends() -> None:
    assert choose_backend("torch", cuda=True, fetch_hub=unexpected_fetch).backend == "torch"
    assert choose_backend("builtin", cuda=True, fetch_hub=unexpected_fetch, builtin=lambda: print).backend == "builtin"
    assert choose_backend("fa3", cuda=True, fetch_hub=lambda: object()).backend == "fa3"


@pytest.mark.parametrize(
    ("requested", "cuda", "fetch", "builtin", "message"),
    [("fa3", False, unexpected_fetch, lambda: print, "TRAINER_ATTENTION=fa3 needs a CUDA GPU"),
     ("builtin", False, unexpected_fetch, lambda: print, "TRAINER_ATTENTION=builtin needs a CUDA GPU"),
     ("fa3", True, unreachable_hub, lambda: print, "TRAINER_ATTENTION=fa3: .*cannot be loaded.*offline"),
     ("builtin", True, unexpected_fetch, lambda: None, "TRAINER_ATTENTION=builtin: torch .* has no"),
     ("flash", True, unexpected_fetch, lambda: print, "expected auto, fa3, builtin, torch")],
)
def test_a_forced_backend_that_cannot_run_is_a_clear_error(requested, cuda, fetch, builtin, message) -> None:
    with pytest.raises(UnsupportedAttention, match=message):
        choose_backend(requested, cuda=cuda, fetch_hub=fetch, builtin=builtin)


# --- the GPU tests' and the benchmark's tree layout is TRL's -------------------------------------------------------


def test_grpo_tree_layout_equals_trls_tree_row_packing() -> None:
    from trl.experimental.async_grpo.packing import TreeRow

    prompt_tokens, completions = 5, [[3, 1, 4], [2, 6]]
    row = TreeRow()
    token = 1000
    for group, lengths in enumerate(completions):
        prompt = list(range(100 * (group + 1), 100 * (group + 1) + prompt_tokens))
        for length in lengths:
            completion = list(range(token, token + length))
            token += length
            ids = torch.tensor(prompt + completion)
            row.add({"input_ids": ids, "completion_mask": torch.tensor([0] * prompt_tokens + [1] * length),
                     "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": group})
    packed = row.pack()
    tree = grpo_tree(prompt_tokens, completions)
    assert tree.tokens == packed["input_ids"].numel()
    assert torch.equal(tree.kv_index, packed["tree_kv_index"])
    assert torch.equal(tree.cu_q, packed["tree_cu_seqlens_q"])
    assert torch.equal(tree.cu_k, packed["tree_cu_seqlens_k"])
    assert [tree.max_q, tree.max_k] == packed["tree_max_seqlens"].tolist()
