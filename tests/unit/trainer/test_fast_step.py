"""The fast trainer step computes TRL's loss: loss, LoRA gradients and metrics against TRL's own path, on CPU.

The kernel lever (Liger's Triton kernels) needs a GPU: `bench/trainer_bench.py --equivalence` checks it on the
H200 and the result is kept in bench/results/bench-trainer.json. Here: the host-compacted batch, the sync-free
loss with the indexed log-probability head, the fused LoRA product, the prefetching stream and its staleness rule.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import torch
from lorafleet_trainer.attention import install
from lorafleet_trainer.fast_step.loss import FAST_KEY, _nanmax, _nanmin, compact_batch
from lorafleet_trainer.fast_step.options import FAST, PLAIN, step_options
from lorafleet_trainer.fast_step.prefetch import MicroBatchStream, StepVersions
from lorafleet_trainer.fused_lora import FusedLoRALinear, fuse_lora_layers, unfuse_lora_layers
from lorafleet_trainer.step_check import CheckBatch, build_batch, compare_paths, run_fast, run_plain
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

VOCAB = 211


def tiny_trl_model(seed: int = 0):
    """A tiny Qwen2 as TRL 1.16 builds it (tree attention, fused log-probability head), LoRA r=1 all-linear.

    The LoRA B matrices are random (PEFT starts them at zero, where A gets no gradient).
    """
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    install("torch")
    register_tree_attention()
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    config._attn_implementation = TREE_ATTENTION
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


SPEC = CheckBatch(vocab=VOCAB, token_budget=700, group_size=4, prompt_tokens=(8, 30), completion_tokens=(5, 60))


def test_fast_loss_equals_trl_loss_gradients_and_metrics_on_cpu():
    batch = build_batch(SPEC)
    report = compare_paths(tiny_trl_model(), batch, fused_lora=True)
    diff = report["fast_vs_plain"]
    # shared completion prefixes: a scored position serves several loss terms
    assert report["loss_terms"] > report["scored_positions"] > 100
    assert diff["loss_rel"] < 1e-5, report
    assert diff["grad_max_rel"] < 1e-4 and diff["grad_cosine"] > 1 - 1e-8, report
    assert diff["metric_max_abs"] < 1e-5 and diff["same_metric_keys"] and diff["same_accounting"], report
    assert report["plain_vs_plain"]["loss_abs"] == 0.0  # CPU: the reference path is reproducible


def test_the_sync_free_loss_alone_is_trl_loss():
    """Without the fused LoRA layers: only the compaction, the indexed head and the loss change."""
    from lorafleet_trainer.fast_step.loss import install_indexed_head

    batch = build_batch(SPEC)
    model = tiny_trl_model(seed=3)
    device = torch.device("cpu")
    plain = run_plain(model, batch, device=device, autocast=None, gradient_accumulation_steps=3)
    assert install_indexed_head(model.get_base_model(), 1.0)
    fast = run_fast(model, batch, device=device, autocast=None, gradient_accumulation_steps=3)
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(fast["grads"][name], grad, rtol=1e-5, atol=1e-7)
    assert fast["metrics"].keys() == plain["metrics"].keys()
    for key, value in plain["metrics"].items():
        assert fast["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    assert fast["accounting"] == plain["accounting"]


def test_compact_batch_selects_what_trl_selects_on_the_gpu():
    batch = build_batch(SPEC)
    compact = compact_batch(batch)
    mask = batch["attention_mask"].bool()
    selected = batch["token_index"] >= 0
    assert torch.equal(compact["input_ids"][0], batch["input_ids"][mask])
    labels = batch["shift_labels"][mask]
    positions = batch["token_index"][selected]
    # each loss term's row in the scored list is its position's row: same log-probability as TRL's gather
    assert torch.equal(compact["label_index"][compact["compact_index"]], positions)
    assert torch.equal(compact["labels"], labels[labels != -100])
    assert compact["label_index"].tolist() == sorted(compact["label_index"].tolist())
    counts = compact[FAST_KEY]
    assert counts.num_seq == len(set(batch["segment_id"][selected].tolist()))
    assert [counts.tree_max_seqlen_q, counts.tree_max_seqlen_k] == batch["tree_max_seqlens"][0].tolist()


def test_compact_batch_strips_inter_rank_padding_like_trl():
    """A row padded for the dispatcher (as on several ranks) compacts to the unpadded row."""
    batch = build_batch(SPEC)
    padded = {}
    fill = {"input_ids": 0, "shift_labels": -100, "token_index": -1, "tree_kv_index": -1, "tree_cu_seqlens_q": -1,
            "tree_cu_seqlens_k": -1, "attention_mask": 0}
    for key, value in batch.items():
        if key in ("global_n_tokens", "global_n_forward_tokens", "mean_seq_len", "tree_max_seqlens"):
            padded[key] = value
        else:
            padded[key] = torch.cat([value, torch.full((1, 5), fill.get(key, 0), dtype=value.dtype)], dim=1)
    for key, value in compact_batch(batch).items():
        theirs = compact_batch(padded)[key]
        assert torch.equal(theirs, value) if isinstance(value, torch.Tensor) else theirs == value, key


@pytest.mark.parametrize("values", [[0.5, float("nan"), 0.25], [float("nan"), float("nan")], [1.0], [0.0, 0.0]])
def test_nan_extremes_match_trl(values):
    from trl.trainer.utils import nanmax, nanmin

    tensor = torch.tensor(values)
    torch.testing.assert_close(_nanmin(tensor), nanmin(tensor), equal_nan=True)
    torch.testing.assert_close(_nanmax(tensor), nanmax(tensor), equal_nan=True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_linear_matches_peft_formula(bias, dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 24, dtype=dtype, requires_grad=True)
    weight = torch.randn(40, 24, dtype=dtype)
    b = torch.randn(40, dtype=dtype) if bias else None
    lora_a = torch.randn(2, 24, requires_grad=True)
    lora_b = torch.randn(40, 2, requires_grad=True)
    grad = torch.randn(37, 40, dtype=dtype)

    def plain():
        a, bb = lora_a.to(dtype), lora_b.to(dtype)
        out = torch.nn.functional.linear(x, weight, b)
        return out + torch.nn.functional.linear(torch.nn.functional.linear(x, a), bb) * 2.0

    def fused():
        return FusedLoRALinear.apply(x, weight, b, lora_a.to(dtype), lora_b.to(dtype), 2.0)

    results = []
    for fn in (plain, fused):
        for tensor in (x, lora_a, lora_b):
            tensor.grad = None
        out = fn()
        out.backward(grad)
        results.append((out.detach().float(), x.grad.float(), lora_a.grad.clone(), lora_b.grad.clone()))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for name, theirs, ours in zip(("out", "x", "A", "B"), *results, strict=True):
        torch.testing.assert_close(ours, theirs, **tol, msg=name)


def test_fused_lora_layers_route_plain_layers_and_leave_disabled_adapters_to_peft():
    model = tiny_trl_model()
    layer = model.get_base_model().model.layers[0].mlp.gate_proj
    x = torch.randn(5, 3, 64)
    with torch.no_grad():
        reference, base = layer(x), layer.base_layer(x)
    count = fuse_lora_layers(model)
    assert count == 2 * 7  # q k v o gate up down, per layer
    with torch.no_grad():
        fused = layer(x)
        with model.disable_adapter():
            disabled = layer(x)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(disabled, base)  # adapters off: PEFT's path, the base layer alone
    unfuse_lora_layers(model)
    assert all("forward" not in module.__dict__ for module in model.modules() if hasattr(module, "lora_A"))


def test_step_options_fast_only_on_one_cuda_process():
    assert step_options(True, device="cuda", sharding="none") == FAST
    assert step_options(False, device="cuda", sharding="none") == PLAIN
    assert step_options(True, device="cpu", sharding="none") == PLAIN
    assert step_options(True, device="cuda", sharding="fsdp2") == PLAIN
    assert step_options(True, device="cuda", sharding="ddp") == PLAIN


def test_versions_are_those_of_the_step_that_trains_the_micro_batch():
    # GA 3, a sync every 2 steps; the run starts after step 4 (resumed) at version 7
    versions = StepVersions(gradient_accumulation_steps=3, weight_sync_steps=2, start_step=4, start_version=7)
    # micro-batches 0-2: step 5 (version 7); 3-5: step 6 (the sync at the end of step 6 comes after) -> 7;
    # 6-8: step 7 -> 8 (synced at the end of step 6); 9-11: step 8 -> 8; 12: step 9 -> 9
    assert [versions.at(b, current=7) for b in range(13)] == [7] * 6 + [8] * 6 + [9]
    assert versions.at(0, current=9) == 9  # never below what the trainer already is at


class _Planner:
    """TRL's planner contract: yields rows; appends metrics into the stream's sink as samples are pulled."""

    def __init__(self, stream, batches, delay=0.0, fail_at=None):
        self.stream, self.batches, self.delay, self.fail_at = stream, batches, delay, fail_at
        self.pulled_at: list[int] = []

    def __iter__(self):
        for index in range(self.batches):
            if index == self.fail_at:
                raise RuntimeError("rollout worker died")
            time.sleep(self.delay)
            self.pulled_at.append(self.stream.building)
            self.stream.sink["sample/staleness_mean"].append(float(index))
            yield [index]


def _collate(stream):
    def collate(examples):
        (rows,) = examples
        stream.groups.add(rows[0])
        stream.sink["batch/samples_per_row"].append(1.0)
        return {"index": torch.tensor(rows)}
    return collate


@pytest.mark.parametrize("threaded", [False, True])
def test_stream_delivers_each_batch_with_its_own_metrics_and_groups_in_order(threaded):
    delivered = []
    sink, trained = defaultdict(list), set()

    def deliver(metrics, groups):
        delivered.append((dict(metrics), set(groups)))
        for key, values in metrics.items():
            sink[key].extend(values)
        trained.update(groups)

    stream = MicroBatchStream(deliver=deliver, threaded=threaded, depth=2)
    planner = _Planner(stream, batches=5, delay=0.01)
    stream.bind(planner, _collate(stream))
    seen = []
    for batch in stream:
        seen.append(int(batch["index"]))
        # a micro-batch's groups count as trained when the loop takes it, not when the thread packs it
        assert trained == set(seen)
    assert seen == [0, 1, 2, 3, 4]
    assert [groups for _, groups in delivered] == [{0}, {1}, {2}, {3}, {4}]
    assert [metrics["sample/staleness_mean"] for metrics, _ in delivered] == [[0.0], [1.0], [2.0], [3.0], [4.0]]
    assert sink["batch/samples_per_row"] == [1.0] * 5
    assert planner.pulled_at == [0, 1, 2, 3, 4]  # each batch's samples were pulled while that batch was built


def test_threaded_stream_packs_ahead_while_the_loop_works_and_is_bounded():
    stream = MicroBatchStream(deliver=lambda *_: None, threaded=True, depth=2)
    planner = _Planner(stream, batches=6, delay=0.05)
    stream.bind(planner, _collate(stream))
    iterator = iter(stream)
    next(iterator)
    # The training loop is busy: the thread packs ahead, `depth` batches handed over and one in hand, then waits
    # (however fast the machine: waited for, not assumed after a sleep; and no more once it waits).
    deadline = time.monotonic() + 30
    while len(planner.pulled_at) < 1 + 2 + 1:
        assert time.monotonic() < deadline, planner.pulled_at
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(planner.pulled_at) == 4
    assert next(iterator)["index"].tolist() == [1]  # packed before the loop asked for it


def test_threaded_stream_raises_the_packing_error_in_the_training_loop():
    stream = MicroBatchStream(deliver=lambda *_: None, threaded=True, depth=1)
    stream.bind(_Planner(stream, batches=5, fail_at=2), _collate(stream))
    with pytest.raises(RuntimeError, match="rollout worker died"):
        list(stream)
    time.sleep(0.3)
    assert not any(thread.name == "lorafleet-prefetch" and thread.is_alive() for thread in threading.enumerate())


def _rollout_samples(count: int, seed: int = 0):
    """TRL RolloutSamples as the rollout worker queues them: groups of 4, some too stale to train."""
    import random

    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    rng = random.Random(seed)
    samples = []
    for index in range(count):
        group = index // 4
        prompt = [1 + (group * 7 + k) % (VOCAB - 1) for k in range(6)]
        completion = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 40))]
        ids = np.array(prompt + completion)
        samples.append(RolloutSample(
            prompt=[], completion=[], input_ids=ids,
            completion_mask=np.array([0] * len(prompt) + [1] * len(completion)),
            old_log_probs=np.array([0.0] * len(prompt) + [-5.0] * len(completion), dtype=np.float32),
            advantage=rng.uniform(-1, 1), model_version=3 if group % 5 == 4 else 5, group_id=group,
            metrics={"reward": float(index)},
        ))
    return samples


def _take(stream, count):
    taken = []
    for batch in stream:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken


def test_packing_process_packs_what_trl_packs_in_process():
    """The spawned packer: the same micro-batches, metrics and groups as TRL's chain run here, stale samples dropped."""
    import multiprocessing
    import queue as queues

    from accelerate import PartialState
    from lorafleet_trainer.fast_step.packing_process import PackingProcess
    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        RolloutQueueDataset,
        TokenBudgetBatcher,
    )

    PartialState(cpu=True)  # TRL's logger needs it (the trainer has one)
    samples = _rollout_samples(120)
    versions = StepVersions(gradient_accumulation_steps=2, weight_sync_steps=4, start_step=0, start_version=5)

    def record(into):
        def deliver(metrics, groups):
            into.append((metrics, groups))
        return deliver

    here_queue: queues.Queue = queues.Queue()
    for sample in samples:
        here_queue.put(sample)
    here_extras: list = []
    here = MicroBatchStream(deliver=record(here_extras), prepare=compact_batch)
    rollouts = RolloutQueueDataset(here_queue, lambda: versions.at(here.building, 5), lambda _s: None, 0.0,
                                   here.sink, max_staleness=1, poll_interval_s=0.1)
    here.bind(TokenBudgetBatcher(rollouts, 1, 300, here.sink),
              DataCollatorForRollout(0, 1, groups_trained=here.groups, metrics=here.sink, token_budget=300))
    expected = _take(here, 5)

    ctx = multiprocessing.get_context("spawn")
    shared_queue, value = ctx.Queue(), ctx.Value("i", 5)
    for sample in samples:
        shared_queue.put(sample)
    there_extras: list = []
    checks: list = []
    there = MicroBatchStream(deliver=record(there_extras))
    there.process = PackingProcess(rollout_queue=shared_queue, version_value=value, versions=versions,
                                   pad_token_id=0, token_budget=300, batch_size=8, max_staleness=1, compact=True,
                                   depth=2, idle_check=lambda: checks.append(1), poll_s=30.0)
    got = _take(there, 5)
    assert len(got) == len(expected) == 5
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.keys() == theirs.keys()
        for key, value_ in theirs.items():
            assert torch.equal(ours[key], value_) if isinstance(value_, torch.Tensor) else ours[key] == value_, key
    for (metrics, groups), (their_metrics, their_groups) in zip(there_extras, here_extras, strict=True):
        assert groups == their_groups
        for key, values in their_metrics.items():
            if key != "sample/rollout_queue_size":  # a queue length at the moment of the pull
                assert metrics[key] == values, key
    assert any(metrics.get("sample/dropped_stale_total") for metrics, _ in there_extras)  # version 3 > 1 stale
    assert not any(proc.name == "lorafleet-packer" for proc in multiprocessing.active_children())


def test_packing_process_errors_reach_the_training_loop():
    import multiprocessing

    from lorafleet_trainer.fast_step.packing_process import PackingProcess

    ctx = multiprocessing.get_context("spawn")
    broken = ctx.Queue()
    broken.put("not a rollout sample")
    stream = MicroBatchStream(deliver=lambda *_: None)
    stream.process = PackingProcess(rollout_queue=broken, version_value=ctx.Value("i", 1),
                                    versions=StepVersions(1, 1), pad_token_id=0, token_budget=100, batch_size=2,
                                    max_staleness=1, compact=True, depth=1, poll_s=30.0)
    with pytest.raises(AttributeError):
        next(iter(stream))
