"""Training attention kernels on a GRPO tree-packed micro-batch: forward + backward time per layer.

Reproduces the README's kernel table on a CUDA GPU (`make bench-attention`, or
`python bench/attention_bench.py --out bench/results/bench-attention.json`): Qwen2.5-1.5B attention
shapes (12 query heads, 2 key/value heads, head dim 128), bf16, one micro-batch of 2 prompts x 8
completions laid out exactly as TRL's `TreeRow.pack` lays it out (14,484 query tokens, 19,284 key
tokens), keys and values gathered through `tree_kv_index` as TRL's `tree_attention` does. Each
kernel runs 2 warm-ups then 5 timed forward+backward passes; 28 layers = 28 x one layer.

Needs only torch (and the trainer's `lorafleet_trainer.attention`, the run record of `lorafleet_ops.docsite.record`),
not TRL: it runs on a GPU machine without TRL, vLLM or a package registry
(`PYTHONPATH=ops:services/trainer python bench/attention_bench.py`; the .venv has both packages installed).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_trainer.attention import KERNELS, torch_varlen_attn

HEADS_Q, HEADS_KV, HEAD_DIM, LAYERS = 12, 2, 128, 28  # Qwen2.5-1.5B
PROMPT_TOKENS = 301
# Completion lengths of the two groups (8 each); 6,934 tokens per group, as in a real GRPO micro-batch.
COMPLETIONS = [[500, 612, 745, 803, 880, 1011, 1150, 1233], [1233, 1150, 1011, 880, 803, 745, 612, 500]]


@dataclass(frozen=True)
class Tree:
    """TRL's tree packing of GRPO groups: `tokens` packed positions, segments and their root-to-segment paths."""

    tokens: int
    kv_index: torch.Tensor  # (K,) packed position of every gathered key/value row
    cu_q: torch.Tensor  # (S + 1,) int32 segment boundaries
    cu_k: torch.Tensor  # (S + 1,) int32 path boundaries in kv_index
    max_q: int
    max_k: int


def grpo_tree(prompt_tokens: int, completions: list[list[int]]) -> Tree:
    """The layout TRL's `TreeRow.pack` gives groups of completions sharing one prompt (distinct first tokens).

    TRL keys a trie node on (token, next token), so a group forks one token before the completions
    diverge: the shared root segment is the prompt's first `prompt_tokens - 1` tokens, and every
    completion's segment is the prompt's last token plus the completion, attending to the root's
    keys and its own. Segments come in DFS pre-order, groups in order.
    """
    kv_index: list[int] = []
    cu_q, cu_k = [0], [0]
    position = 0
    for lengths in completions:
        root = list(range(position, position + prompt_tokens - 1))
        position += len(root)
        kv_index += root
        cu_q.append(position)
        cu_k.append(len(kv_index))
        for length in lengths:
            segment = list(range(position, position + 1 + length))
            position += len(segment)
            kv_index += root + segment
            cu_q.append(position)
            cu_k.append(len(kv_index))
    q_lens = [b - a for a, b in pairwise(cu_q)]
    k_lens = [b - a for a, b in pairwise(cu_k)]
    return Tree(position, torch.tensor(kv_index), torch.tensor(cu_q, dtype=torch.int32),
                torch.tensor(cu_k, dtype=torch.int32), max(q_lens), max(k_lens))


def attention_inputs(tree: Tree, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Random q (tokens, Hq, D) and k, v (tokens, Hkv, D) leaves, as the attention layer receives them."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(tree.tokens, HEADS_Q, HEAD_DIM), (tree.tokens, HEADS_KV, HEAD_DIM), (tree.tokens, HEADS_KV, HEAD_DIM)]
    return [torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_() for shape in shapes]


def tree_attention(kernel: str, tree: Tree, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   window: tuple[int, int] = (-1, -1), causal: bool = True) -> torch.Tensor:
    """Call a kernel the way TRL's `tree_attention` does: gather each path's keys/values, causal, scale 1/sqrt(D)."""
    index = tree.kv_index.to(q.device)
    return KERNELS[kernel](
        q, k.index_select(0, index), v.index_select(0, index), tree.cu_q.to(q.device), tree.cu_k.to(q.device),
        tree.max_q, tree.max_k, softmax_scale=HEAD_DIM**-0.5, causal=causal, window_size=window,
    )


def time_kernel(kernel: str, tree: Tree, warmups: int = 2, repeats: int = 5) -> dict[str, float]:
    q, k, v = attention_inputs(tree, torch.bfloat16, "cuda")
    grad = torch.randn_like(q)
    times = []
    for i in range(warmups + repeats):
        for tensor in (q, k, v):
            tensor.grad = None
        torch.cuda.synchronize()
        started = time.perf_counter()
        tree_attention(kernel, tree, q, k, v).backward(grad)
        torch.cuda.synchronize()
        if i >= warmups:
            times.append(time.perf_counter() - started)
    per_layer = sum(times) / len(times)
    return {"per_layer_ms": round(per_layer * 1e3, 3), "layers_28_s": round(per_layer * LAYERS, 4),
            "runs_ms": [round(t * 1e3, 3) for t in times]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-attention.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA GPU (this machine has none)", file=sys.stderr)
        return 2
    tree = grpo_tree(PROMPT_TOKENS, COMPLETIONS)
    kernels = ["torch"] + (["builtin"] if torch_varlen_attn() is not None else [])
    results = {name: time_kernel(name, tree) for name in kernels}
    q, k, v = attention_inputs(tree, torch.bfloat16, "cuda", seed=1)
    with torch.no_grad():
        diff = None
        if "builtin" in results:
            diff = (tree_attention("builtin", tree, q, k, v).float()
                    - tree_attention("torch", tree, q, k, v).float()).abs().max().item()
    report = {
        RECORD_KEY: run_record(),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
        "dtype": "bfloat16", "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
        "query_tokens": tree.tokens, "key_tokens": int(tree.kv_index.numel()), "segments": len(tree.cu_q) - 1,
        "kernels": results, "max_abs_diff_builtin_vs_torch": diff,
        "speedup_builtin_vs_torch": (round(results["torch"]["per_layer_ms"] / results["builtin"]["per_layer_ms"], 1)
                                     if "builtin" in results else None),
    }
    write_result(args.out, report)
    print(f"{report['device']}, torch {report['torch']}, bf16, {tree.tokens} query / {report['key_tokens']} key "
          f"tokens, {report['segments']} segments, forward + backward, mean of 5 after 2 warm-ups")
    print(f"{'kernel':<10} {'per layer':>12} {'28 layers':>12}")
    for name, figures in results.items():
        print(f"{name:<10} {figures['per_layer_ms']:>9.2f} ms {figures['layers_28_s']:>10.3f} s")
    print(f"max |builtin - torch| = {diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
