"""The sync-free loss lever: TRL's loss on a micro-batch selected on the host, with nothing read back per micro-batch.

`compact_batch` runs on the packing side (prefetch.py, packing_process.py), `sync_free_loss` in the trainer's
`compute_loss`, `flush_loss_metrics` once at the step's end; `install_indexed_head` lets TRL's log-probability head
take the scored positions as indices, which `sync_free_loss` passes it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from lorafleet_trainer.fast_step.timing import StepTimer

FAST_KEY = "lorafleet_host_counts"  # the compacted micro-batch's host-side numbers, in the batch dict


@dataclass(frozen=True)
class HostCounts:
    """What TRL's loss reads back from the GPU per micro-batch, known on the host before the copy."""

    tree_max_seqlen_q: int
    tree_max_seqlen_k: int
    num_seq: int  # completions in the row
    n_forward_tokens: float
    mean_seq_len: float
    n_trained_tokens: float


TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


def compact_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """TRL's collated one-rank micro-batch (CPU tensors) -> what `sync_free_loss` needs, selected here on the host.

    The same selections as TRL's `compute_loss` (boolean masks over the padded row), plus the positions the
    log-probability head scores (`label_index`: where `shift_labels` != -100, ascending, as TRL's mask orders them)
    and, for each loss term, its row in that scored list (`compact_index`).
    """
    mask = batch["attention_mask"].bool()
    selected = batch["token_index"] >= 0
    shift_labels = batch["shift_labels"][mask]
    label_index = (shift_labels != -100).nonzero().squeeze(1)
    lookup = torch.full((shift_labels.numel(),), -1, dtype=torch.long)
    lookup[label_index] = torch.arange(label_index.numel())
    token_index = batch["token_index"][selected]
    compact_index = lookup[token_index]
    if (compact_index < 0).any():
        raise ValueError("a loss term points at a position without a label")
    segment_id = batch["segment_id"][selected]
    max_q, max_k = batch["tree_max_seqlens"][0].tolist()
    out = {
        "input_ids": batch["input_ids"][mask].unsqueeze(0),
        "position_ids": batch["position_ids"][mask].unsqueeze(0),
        "label_index": label_index,
        "labels": shift_labels[label_index],
        "compact_index": compact_index,
        "old_log_probs": batch["old_log_probs"][selected],
        "advantages": batch["advantages"][selected],
        "segment_id": segment_id,
        "global_n_tokens": batch["global_n_tokens"][:1].clone(),
        **{key: batch[key][batch[key] >= 0] for key in TREE_KEYS},
    }
    out[FAST_KEY] = HostCounts(
        tree_max_seqlen_q=int(max_q), tree_max_seqlen_k=int(max_k),
        num_seq=int(segment_id.max()) + 1 if segment_id.numel() else 0,
        n_forward_tokens=float(batch["global_n_forward_tokens"][0]), mean_seq_len=float(batch["mean_seq_len"][0]),
        n_trained_tokens=float(batch["global_n_tokens"][0]),
    )
    return out


def _nanmin(values: torch.Tensor) -> torch.Tensor:
    """TRL's `nanmin` (NaN when every value is NaN) without its host synchronisation."""
    nan = torch.isnan(values)
    low = torch.where(nan, torch.full_like(values, float("inf")), values).amin()
    return torch.where(nan.all(), torch.full_like(low, float("nan")), low)


def _nanmax(values: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(values)
    high = torch.where(nan, torch.full_like(values, float("-inf")), values).amax()
    return torch.where(nan.all(), torch.full_like(high, float("nan")), high)


LOSS_METRICS = ("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max")


def sync_free_loss(trainer: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """TRL 1.16's `AsyncGRPOTrainer.compute_loss` on a `compact_batch`, without reading anything back from the GPU.

    One rank, no MoE auxiliary loss (the trainer falls back to TRL's loss otherwise). The loss is TRL's, op for op;
    the metrics TRL appends per micro-batch go to `trainer._pending_loss_metrics` as one GPU vector each
    (`flush_loss_metrics` appends them at the step's end). `trainer` is the AsyncGRPOTrainer (or a stand-in with
    its attributes: epsilon_low/high, current_gradient_accumulation_steps, the `_step_*` accumulators).
    """
    counts: HostCounts = inputs[FAST_KEY]
    timer: StepTimer = trainer._step_timer
    started = timer.forward()
    outputs = model(
        input_ids=inputs["input_ids"],
        position_ids=inputs["position_ids"],
        fused_lm_head=True,
        fused_label_index=inputs["label_index"],
        fused_labels=inputs["labels"],
        tree_kv_index=inputs["tree_kv_index"],
        tree_cu_seqlens_q=inputs["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=inputs["tree_cu_seqlens_k"],
        tree_max_seqlen_q=counts.tree_max_seqlen_q,
        tree_max_seqlen_k=counts.tree_max_seqlen_k,
    )
    compact_index = inputs["compact_index"]
    log_probs = outputs.log_probs[compact_index]
    entropy = outputs.entropy[compact_index]
    trainer._last_forward_time_s = timer.forward_done(started)

    old_log_probs, advantages, segment_id = inputs["old_log_probs"], inputs["advantages"], inputs["segment_id"]
    log_ratio = log_probs - old_log_probs
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    loss = per_token_loss.sum()
    global_n_tokens = inputs["global_n_tokens"][0]
    tokens_per_rank = (global_n_tokens / 1).clamp(min=1.0)  # one rank: world_size 1, as TRL divides
    loss = loss / tokens_per_rank.to(torch.float32)
    loss = loss / trainer.current_gradient_accumulation_steps

    with torch.no_grad():
        count = torch.full_like(coef_1.sum(), float(log_probs.numel()))
        is_low_clipped = (coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        sums = torch.stack([coef_1.sum(), ((coef_1 - 1) - log_ratio).sum(), entropy.sum(),
                            is_low_clipped.float().sum(), is_high_clipped.float().sum(),
                            is_region_clipped.float().sum()])
        means = sums / count

        def seg_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(counts.num_seq, device=values.device).index_add_(0, segment_id, values)

        seq_tokens = seg_sum(torch.ones_like(coef_1, dtype=torch.float32))
        per_seq_low = seg_sum(is_low_clipped.float()) / seq_tokens
        per_seq_high = seg_sum(is_high_clipped.float()) / seq_tokens
        extremes = torch.stack([_nanmin(per_seq_low), _nanmax(per_seq_high)])
        trainer._pending_loss_metrics.append(torch.cat([means, extremes]))

    n_forward_tokens = counts.n_forward_tokens
    trainer._step_forward_tokens += n_forward_tokens
    trainer._step_trained_tokens += counts.n_trained_tokens
    trainer._step_seq_len_weighted += counts.mean_seq_len * n_forward_tokens
    trainer._step_samples += n_forward_tokens / counts.mean_seq_len
    trainer._step_forward_s += trainer._last_forward_time_s
    return loss


def flush_loss_metrics(pending: list[torch.Tensor], sink: dict[str, list]) -> None:
    """Append the step's per-micro-batch loss metrics to TRL's sink: one device-to-host read for the whole step."""
    if not pending:
        return
    rows = torch.stack(pending).tolist()
    pending.clear()
    for row in rows:
        for key, value in zip(LOSS_METRICS, row, strict=True):
            sink[key].append(value)


def install_indexed_head(model: Any, temperature: float) -> bool:
    """Let TRL's fused log-probability head take the positions to score as indices (no boolean mask on the GPU).

    `model` is the transformers model TRL patched with `add_fused_lm_head` (PEFT's base model). Called with
    `fused_label_index` (positions, ascending) and `fused_labels`, the forward returns the log-probabilities and
    entropies of exactly those positions, in that order: the rows TRL's mask selects, through the same kernel.
    Without them it is TRL's forward. Returns False (nothing changed) for heads TRL scales or soft-caps, and MoE.
    """
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, FusedCausalLMOutput

    text_config = model.config.get_text_config()
    special = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
    if any(getattr(text_config, name, None) is not None for name in special):
        return False
    if getattr(text_config, "output_router_logits", False) or text_config is not model.config:
        return False
    trl_forward = model.forward

    def forward(self: Any, *args: Any, fused_label_index: torch.Tensor | None = None,
                fused_labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if fused_label_index is None:
            return trl_forward(*args, **kwargs)
        for key in ("fused_lm_head", "labels", "shift_labels", "num_items_in_batch"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        lm_head = self.get_output_embeddings()
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, fused_label_index)
        log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
            hidden, lm_head.weight, lm_head.bias, fused_labels, temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
            ("log_probs", "entropy"),
        )
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy)

    model.forward = types.MethodType(forward, model)
    return True
