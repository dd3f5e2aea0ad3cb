"""Does the fast step compute TRL's loss? Loss, LoRA gradients and metrics of both paths on one fixed micro-batch.

`compare_paths` runs TRL 1.16's own `AsyncGRPOTrainer.compute_loss` + backward on a model, then the same model
through the fast step's levers (fast_step/: the host-compacted batch, the sync-free loss and the indexed
log-probability head; fused_lora.py; Liger's kernels on a GPU) on the same batch, and reports the differences.
The plain path runs twice: the second run is the noise floor (GPU kernels that accumulate with atomics are not
bitwise reproducible). tests/unit/trainer/test_fast_step.py runs it on CPU with a tiny Qwen2;
`bench/trainer_bench.py --equivalence` on a GPU at the benchmark's shape, with Liger.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from lorafleet_trainer.fast_step.loss import compact_batch, flush_loss_metrics, install_indexed_head, sync_free_loss
from lorafleet_trainer.fast_step.timing import StepTimer


@dataclass(frozen=True)
class CheckBatch:
    """A synthetic micro-batch like TRL's: groups of rollouts sharing a prompt, packed into one row."""

    vocab: int
    token_budget: int
    group_size: int = 8
    prompt_tokens: tuple[int, int] = (40, 120)
    completion_tokens: tuple[int, int] = (20, 600)
    shared_prefix: float = 0.5  # chance a rollout starts like its group's first (a shared trie path, shared terms)
    seed: int = 0


def build_batch(spec: CheckBatch, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """TRL's collated micro-batch (one rank) of `spec`: its TreeRow packing and DataCollatorForRollout."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    rng = random.Random(spec.seed)
    row, group = TreeRow(), 0
    uniform = math.log(spec.vocab)
    while True:
        prompt = [rng.randrange(1, spec.vocab) for _ in range(rng.randint(*spec.prompt_tokens))]
        rewards = [rng.random() for _ in range(spec.group_size)]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        placed, first = 0, None
        for reward in rewards:
            completion = [rng.randrange(1, spec.vocab) for _ in range(rng.randint(*spec.completion_tokens))]
            if first is None:
                first = completion
            elif rng.random() < spec.shared_prefix:
                completion = first[: rng.randint(1, len(first))] + completion
                completion = completion[: spec.completion_tokens[1]]
            ids = prompt + completion
            sample = {
                "input_ids": torch.tensor(ids),
                "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion)),
                # near the random model's log-probabilities: ratios around 1, some clipped on either side
                "old_log_probs": torch.tensor([0.0] * len(prompt)
                                              + [-uniform + rng.gauss(0, 0.3) for _ in completion]),
                "advantage": (reward - mean) / (std + 1e-8),
                "group_id": group,
                "metrics": {},
            }
            if not row.fits(sample, spec.token_budget):
                break
            row.add(sample)
            placed += 1
        if placed < spec.group_size:
            break
        group += 1
    if not row.samples:
        raise ValueError("token_budget holds no sample")
    return DataCollatorForRollout(pad_token_id, 1, token_budget=spec.token_budget)([[row]])


class _OneProcess:
    num_processes = 1

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _trainer_state(gradient_accumulation_steps: int, cuda: bool) -> Any:
    """The attributes of an AsyncGRPOTrainer that both losses read and write."""
    return SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.2, aux_loss_enabled=False, accelerator=_OneProcess(),
        current_gradient_accumulation_steps=gradient_accumulation_steps, _metrics={"train": defaultdict(list)},
        _step_forward_tokens=0.0, _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0,
        _step_forward_s=0.0, _last_forward_time_s=0.0, _pending_loss_metrics=[], _step_timer=StepTimer(cuda),
    )


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.detach().float().clone() for name, param in model.named_parameters()
            if param.requires_grad and param.grad is not None}


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def run_plain(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, device: torch.device,
              autocast: torch.dtype | None, gradient_accumulation_steps: int = 1) -> dict[str, Any]:
    """TRL's own compute_loss + backward; the loss, the LoRA gradients and TRL's loss metrics."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    state = _trainer_state(gradient_accumulation_steps, device.type == "cuda")
    model.zero_grad(set_to_none=True)
    with _autocast(device, autocast):
        loss = AsyncGRPOTrainer.compute_loss(state, model, _to(batch, device))
    loss.backward()
    metrics = {key: values[0] for key, values in state._metrics["train"].items()}
    return {"loss": loss.item(), "grads": _lora_grads(model), "metrics": metrics,
            "accounting": _accounting(state)}


def run_fast(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, device: torch.device,
             autocast: torch.dtype | None, gradient_accumulation_steps: int = 1) -> dict[str, Any]:
    """The fast step's loss (host-compacted batch, sync-free loss, indexed head) + backward; the same report."""
    state = _trainer_state(gradient_accumulation_steps, device.type == "cuda")
    model.zero_grad(set_to_none=True)
    compact = _to(compact_batch(batch), device)
    with _autocast(device, autocast):
        loss = sync_free_loss(state, model, compact)
    loss.backward()
    flush_loss_metrics(state._pending_loss_metrics, state._metrics["train"])
    metrics = {key: values[0] for key, values in state._metrics["train"].items()}
    return {"loss": loss.item(), "grads": _lora_grads(model), "metrics": metrics,
            "accounting": _accounting(state)}


def _accounting(state: Any) -> dict[str, float]:
    return {key: getattr(state, key) for key in ("_step_forward_tokens", "_step_trained_tokens",
                                                 "_step_seq_len_weighted", "_step_samples")}


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def differences(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How far `other` is from `reference`: loss, gradients (worst tensor, whole-vector cosine), metrics."""
    loss_abs = abs(other["loss"] - reference["loss"])
    worst_rel, worst_name, dot, norm_a, norm_b = 0.0, None, 0.0, 0.0, 0.0
    for name, grad in reference["grads"].items():
        theirs = other["grads"][name]
        scale = grad.abs().max().item()
        rel = (theirs - grad).abs().max().item() / scale if scale else (theirs - grad).abs().max().item()
        if rel >= worst_rel:
            worst_rel, worst_name = rel, name
        dot += float((grad.double() * theirs.double()).sum())
        norm_a += float(grad.double().pow(2).sum())
        norm_b += float(theirs.double().pow(2).sum())
    metrics = {key: abs(other["metrics"][key] - value) for key, value in reference["metrics"].items()
               if not (math.isnan(value) and math.isnan(other["metrics"][key]))}
    return {
        "loss": other["loss"],
        "loss_abs": loss_abs,
        "loss_rel": loss_abs / abs(reference["loss"]) if reference["loss"] else loss_abs,
        "grad_max_rel": worst_rel,
        "grad_worst_tensor": worst_name,
        "grad_cosine": dot / math.sqrt(norm_a * norm_b) if norm_a and norm_b else None,
        "grad_norm_ratio": math.sqrt(norm_b / norm_a) if norm_a else None,
        "metric_max_abs": max(metrics.values()) if metrics else 0.0,
        "same_metric_keys": set(reference["metrics"]) == set(other["metrics"]),
        "same_accounting": reference["accounting"] == other["accounting"],
    }


def compare_paths(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                  fused_lora: bool = True, liger: bool = False, autocast: torch.dtype | None = None,
                  reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plain (twice), then the fast path with its levers added one by one, on `model`: a PEFT model as TRL builds it
    (its fused head, tree attention installed). `fast_vs_plain` is the last stage (every lever asked for);
    `stages` has each cumulative stage against the plain path, `plain_vs_plain` the noise floor. With `reference`
    (`run_plain`'s report of the same model in float32: the exact loss), `vs_float32` has every run against it.

    The model is changed in place (indexed head, fused LoRA layers, Liger's modules).
    """
    from lorafleet_trainer.fused_lora import fuse_lora_layers

    device = next(model.parameters()).device
    run = {"device": device, "autocast": autocast}
    plain = run_plain(model, batch, **run)
    again = run_plain(model, batch, **run)
    base = model.get_base_model()
    if not install_indexed_head(base, temperature):
        raise ValueError("the model's head is not one the indexed head supports")
    runs: dict[str, Any] = {}
    runs["sync_free_loss"] = run_fast(model, batch, **run)
    if fused_lora:
        fuse_lora_layers(model)
        runs["+fused_lora"] = run_fast(model, batch, **run)
    if liger:
        from lorafleet_trainer.fast_step.kernels import apply_liger_to_model

        apply_liger_to_model(base)
        runs["+liger"] = run_fast(model, batch, **run)
    fast = list(runs.values())[-1]
    report = {
        "loss_plain": plain["loss"], "loss_fast": fast["loss"],
        "tokens": int(batch["attention_mask"].sum()), "loss_terms": int((batch["token_index"] >= 0).sum()),
        "scored_positions": int((batch["shift_labels"] != -100).sum()),
        "levers": {"sync_free_loss": True, "fused_lora": fused_lora, "liger": liger},
        "fast_vs_plain": differences(plain, fast),
        "plain_vs_plain": differences(plain, again),
        "stages": {name: differences(plain, result) for name, result in runs.items()},
    }
    if reference is not None:
        report["loss_float32"] = reference["loss"]
        report["vs_float32"] = {name: differences(reference, result) for name, result in
                                {"TRL's step": plain, "TRL's step again": again, **runs}.items()}
    return report
