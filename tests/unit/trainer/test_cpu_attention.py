"""The pure-PyTorch varlen kernel against plain causal attention, alone and under TRL's tree packing."""

from __future__ import annotations

import pytest
import torch
from lorafleet_trainer.attention import install
from lorafleet_trainer.attention import torch_varlen_func as flash_attn_varlen_func
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention

TOL = 1e-5


def reference_attention(q, k, v, scale, left=-1):
    """Per-segment attention by the textbook formula: (Lq, Hq, D) x (Lk, Hk, D), bottom-right causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.empty_like(q)
    offset = k.shape[0] - q.shape[0]
    for i in range(q.shape[0]):
        lo = max(0, i + offset - left) if left >= 0 else 0
        keys = slice(lo, i + offset + 1)
        weights = torch.softmax((q[i].unsqueeze(1) * k[keys].transpose(0, 1)).sum(-1) * scale, dim=-1)
        out[i] = (weights.unsqueeze(-1) * v[keys].transpose(0, 1)).sum(1)
    return out


@pytest.mark.parametrize(("lengths_q", "lengths_k", "left"), [([5, 1, 7], [5, 9, 7], -1), ([4, 6], [10, 6], 3)])
def test_varlen_matches_per_segment_causal_attention_with_gqa(lengths_q, lengths_k, left):
    torch.manual_seed(0)
    q = torch.randn(sum(lengths_q), 4, 8)
    k, v = torch.randn(2, sum(lengths_k), 2, 8).unbind(0)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), softmax_scale=0.3, causal=True, window_size=(left, 0)
    )
    for s in range(len(lengths_q)):
        expected = reference_attention(
            q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]], 0.3, left
        )
        torch.testing.assert_close(out[cu_q[s] : cu_q[s + 1]], expected, atol=TOL, rtol=0)


def test_default_scale_is_inverse_sqrt_head_dim_and_non_causal_sees_every_key():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 6, 2, 16).unbind(0)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6)
    weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / 4.0, dim=-1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", weights, v), atol=TOL, rtol=0)


def test_rejects_heads_that_do_not_group():
    q, k = torch.randn(2, 3, 8), torch.randn(2, 2, 8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attn_varlen_func(q, k, k, cu, cu, 2, 2, causal=True)


def _tiny_qwen2(attn: str) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float().eval()


def _sample(ids: list[int], prompt_len: int, group: int) -> dict:
    mask = torch.tensor([0] * prompt_len + [1] * (len(ids) - prompt_len))
    return {
        "input_ids": torch.tensor(ids), "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)),
        "advantage": 1.0, "group_id": group,
    }


def test_trl_tree_attention_packing_equals_plain_causal_attention_per_sample():
    """TRL's own tree_attention + TreeRow packing, with our kernel, reproduce each sample's separate forward."""
    install("torch")
    register_tree_attention()
    plain, tree = _tiny_qwen2("eager"), _tiny_qwen2(TREE_ATTENTION)
    tree.load_state_dict(plain.state_dict())
    prompt_a, prompt_b = [5, 9, 14, 3, 22, 7], [41, 2, 8]
    samples = [  # two groups; completions that share a prefix, fork, and end at different depths
        _sample([*prompt_a, 11, 12, 13, 50], len(prompt_a), 0),
        _sample([*prompt_a, 11, 12, 60], len(prompt_a), 0),
        _sample([*prompt_a, 70, 71, 72, 73, 74], len(prompt_a), 0),
        _sample([*prompt_b, 1, 2, 3, 4, 5, 6], len(prompt_b), 1),
    ]
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    assert packed["input_ids"].numel() < sum(len(s["input_ids"]) for s in samples)  # the prompt is shared

    max_q, max_k = packed["tree_max_seqlens"].tolist()
    tree_logits = tree(
        input_ids=packed["input_ids"].unsqueeze(0), position_ids=packed["position_ids"].unsqueeze(0),
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=max_q, tree_max_seqlen_k=max_k,
    ).logits[0]
    tree_logits.logsumexp(-1).sum().backward()

    selected = iter(packed["token_index"].tolist())
    for i, sample in enumerate(samples):
        ids = sample["input_ids"]
        logits = plain(input_ids=ids.unsqueeze(0)).logits[0]
        logits[:-1][sample["completion_mask"][1:].bool()].logsumexp(-1).sum().backward()
        for position in range(len(ids) - 1):
            if sample["completion_mask"][position + 1]:
                torch.testing.assert_close(
                    tree_logits[next(selected)], logits[position], atol=TOL, rtol=0, msg=f"sample {i} pos {position}"
                )
    # Gradients flow through the kernel: every parameter that got a gradient in the plain model got one here too.
    for (name, p_plain), (_, p_tree) in zip(plain.named_parameters(), tree.named_parameters(), strict=True):
        assert (p_plain.grad is None) == (p_tree.grad is None), name
