"""torch's built-in varlen FlashAttention (`TRAINER_ATTENTION=builtin`) against the pure-PyTorch kernel, on a GPU.

Inputs are laid out exactly as TRL's tree packing lays out a GRPO micro-batch (`bench/attention_bench.py`,
`grpo_tree`; a unit test checks that layout against TRL's own `TreeRow.pack`), with Qwen2.5-1.5B's heads
(GQA 12:2, head dim 128), and gathered through `tree_kv_index` as TRL's `tree_attention` does. The
reference is the pure-PyTorch kernel on float32 copies of the same values; outputs and the gradients
of q, k and v must agree within the half-precision type's tolerance. Needs only torch and pytest:
`PYTHONPATH=services/trainer python -m pytest -m gpu tests/gpu/test_attention_builtin.py`.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from attention_bench import Tree, attention_inputs, grpo_tree, tree_attention
from lorafleet_trainer.attention import UnsupportedAttention, builtin_varlen_func, torch_varlen_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)"),
    pytest.mark.skipif(torch_varlen_attn() is None, reason=f"torch {torch.__version__} has no varlen_attn (>= 2.10)"),
]

# Worst-case deviation from the float32 reference: outputs by absolute error (values are O(1)), gradients by
# relative L2 error (they are sums over many keys). Half precision keeps 8 (bf16) or 11 (fp16) mantissa bits.
TOLERANCE = {torch.bfloat16: {"out": 2e-2, "grad": 2e-2}, torch.float16: {"out": 4e-3, "grad": 4e-3}}
SMALL = grpo_tree(97, [[40, 130, 7, 256], [1, 64, 300, 18]])  # 2 groups x 4, lengths from 1 to 300


def _run(kernel: str, tree: Tree, dtype: torch.dtype, compute: torch.dtype,
         **options: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward + backward of `kernel` on values of precision `dtype`, computed in `compute` (same values for both)."""
    q, k, v = (tensor.detach().to(compute).requires_grad_() for tensor in attention_inputs(tree, dtype, "cuda", seed=3))
    out = tree_attention(kernel, tree, q, k, v, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device="cuda", dtype=dtype)
    out.backward(grad.to(compute))
    return out.detach().float(), [tensor.grad.float() for tensor in (q, k, v)]


def _takes_window() -> bool:
    return "window_size" in inspect.signature(torch_varlen_attn()).parameters


def _compare(tree: Tree, dtype: torch.dtype, **options: object) -> dict[str, float]:
    out, grads = _run("builtin", tree, dtype, dtype, **options)
    ref_out, ref_grads = _run("torch", tree, dtype, torch.float32, **options)
    report = {"out_max_abs": (out - ref_out).abs().max().item()}
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        report[f"d{name}_rel_l2"] = ((grad - ref).norm() / ref.norm()).item()
    print(f"{dtype} {options or ''}: {report}")
    assert report["out_max_abs"] <= TOLERANCE[dtype]["out"], report
    for name in "qkv":
        assert report[f"d{name}_rel_l2"] <= TOLERANCE[dtype]["grad"], report
    return report


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_tree_attention_forward_and_gradients_match_the_reference(dtype: torch.dtype) -> None:
    _compare(SMALL, dtype)


def test_the_benchmark_micro_batch_matches_in_bf16() -> None:
    """The benchmark's timing shape (docs/benchmarks/attention.md): 2 prompts x 8 completions, 14,484 query / 19,284
    key tokens."""
    from attention_bench import COMPLETIONS, PROMPT_TOKENS

    tree = grpo_tree(PROMPT_TOKENS, COMPLETIONS)
    assert (tree.tokens, tree.kv_index.numel()) == (14_484, 19_284)
    _compare(tree, torch.bfloat16)


def test_sliding_window_matches_or_is_refused() -> None:
    """TRL passes window_size=(sliding_window - 1, 0); older torch kernels cannot honour it and must say so."""
    if not _takes_window():
        with pytest.raises(UnsupportedAttention, match="window"):
            _run("builtin", SMALL, torch.bfloat16, torch.bfloat16, window=(31, 0))
        return
    _compare(SMALL, torch.bfloat16, window=(31, 0))


def test_non_causal_attention_matches() -> None:
    if not _takes_window():
        pytest.skip("this torch's varlen_attn takes only is_causal; non-causal checked through is_causal=False")
    _compare(SMALL, torch.bfloat16, causal=False)


def test_float32_and_softcap_are_refused_not_approximated() -> None:
    q, k, v = attention_inputs(SMALL, torch.float32, "cuda")
    cu = SMALL.cu_q.cuda()
    with pytest.raises(UnsupportedAttention, match="float16/bfloat16"):
        builtin_varlen_func(q, k, v, cu, cu, SMALL.max_q, SMALL.max_q, causal=True)
    half = [tensor.detach().bfloat16() for tensor in (q, k, v)]
    with pytest.raises(UnsupportedAttention, match="softcap"):
        builtin_varlen_func(*half, cu, cu, SMALL.max_q, SMALL.max_q, causal=True, softcap=30.0)
