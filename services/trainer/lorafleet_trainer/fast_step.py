"""The trainer's fast step: what TRL 1.16's AsyncGRPOTrainer step does, without leaving the GPU idle.

Measured on one H200 by `make bench-trainer` (README, "Trainer benchmark"), each lever a configuration of its own:

- **prefetch**: TRL packs and collates a step's micro-batches (the prefix trie, ~0.6 s of Python per step) in the
  training thread while the GPU waits. `PackingProcess` runs TRL's own planner and collator in a spawned process
  that reads TRL's rollout queue, one step ahead at most (on a thread, `MicroBatchStream(threaded=True)`, packing
  holds the interpreter lock the training thread needs to launch kernels: measured slower). `MicroBatchStream`
  hands each micro-batch over with the metrics and trained prompt groups it produced, so a step logs and
  checkpoints exactly what it trained. Samples are still dropped as stale against the policy version the
  micro-batch will be trained at (`StepVersions`), as TRL drops them when it packs at the start of that step.
- **sync-free loss**: TRL's `compute_loss` selects tokens with boolean masks on the GPU and reads ~10 metrics with
  `.item()`, about 20 host synchronisations per micro-batch, so every micro-batch starts on an empty GPU queue.
  `compact_batch` does those selections on the host, where the collator's tensors are, before the copy; the loss
  (`sync_free_loss`) is TRL's formula on the compacted tensors, and its metrics stay on the GPU until the step ends
  (one read per step). TRL's log-probability head (`install_indexed_head`) takes the positions to score as indices.
- **fused kernels**: Liger-Kernel's RMSNorm, SwiGLU and RoPE (`apply_liger`, where liger-kernel is installed;
  a pinned, optional dependency) and the fused LoRA product (`fused_lora.py`).

Everything here computes TRL's loss; tests/unit/trainer/test_fast_step.py compares loss, gradients and metrics with
TRL's own path on a fixed batch, and `bench/trainer_bench.py --equivalence` does so on the GPU with the kernels.
The fast step runs on one CUDA process (`TRAINER_FAST_STEP`, default on); CPU runs and several ranks keep TRL's step.
"""

from __future__ import annotations

import inspect
import logging
import queue
import sys
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

FAST_KEY = "lorafleet_host_counts"  # the compacted micro-batch's host-side numbers, in the batch dict


@dataclass(frozen=True)
class StepOptions:
    """Which speed-ups the trainer's step uses (each one is a configuration of `make bench-trainer`)."""

    prefetch: bool = False
    sync_free_loss: bool = False
    fused_lora: bool = False
    liger: bool = False
    # Where prefetching packs: "process" (a spawned packing process: TRL's packing is pure Python, and on a thread
    # it holds the interpreter lock the training thread needs to launch the GPU's kernels) or "thread".
    packing: str = "process"
    # With "thread": Python's thread switch interval (s) while packing ahead; 0 = Python's default (5 ms).
    switch_interval_s: float = 0.0

    @property
    def custom_trainer(self) -> bool:
        """Whether TRL's trainer class needs lorafleet's subclass (the data and loss levers live there)."""
        return self.prefetch or self.sync_free_loss

    def summary(self) -> dict[str, bool]:
        return {"prefetch": self.prefetch, "sync_free_loss": self.sync_free_loss, "fused_lora": self.fused_lora,
                "liger": self.liger, "packing": self.packing if self.prefetch else None,
                "switch_interval_s": self.switch_interval_s}


PLAIN = StepOptions()
FAST = StepOptions(prefetch=True, sync_free_loss=True, fused_lora=True, liger=True)


def step_options(enabled: bool, *, device: str, sharding: str) -> StepOptions:
    """TRAINER_FAST_STEP resolved for this process: the fast step on one CUDA process, TRL's step elsewhere.

    Several ranks (DDP, FSDP2) and CPU runs keep TRL's step: the fast one is measured on one GPU only.
    """
    if enabled and device == "cuda" and sharding == "none":
        return FAST
    return PLAIN


# --- fused RMSNorm / SwiGLU / RoPE (Liger-Kernel) ---------------------------------------------------------------


def apply_liger(model_type: str, model: Any = None) -> str | None:
    """Patch Liger's RMSNorm, SwiGLU and RoPE into `model_type`'s modules (before the model is built), or into the
    built `model`'s modules.

    Returns None when applied, else why not (liger-kernel not installed, or no Liger patch for the architecture).
    Liger's cross-entropy heads stay off: TRL's chunked log-probability head computes the loss's log-probabilities.
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        return f"liger-kernel is not installed ({exc})"
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return f"Liger has no kernels for model type {model_type!r}"
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False}
    accepted = inspect.signature(apply).parameters
    if model is not None:
        wanted["model"] = model
    apply(**{key: value for key, value in wanted.items() if key in accepted})
    return None


def apply_liger_to_model(model: Any) -> None:
    """`apply_liger` on a built transformers model (its config names the architecture); raises if it cannot."""
    reason = apply_liger(model.config.model_type, model=model)
    if reason:
        raise RuntimeError(reason)


# --- the loss without host synchronisation -----------------------------------------------------------------------


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


class StepTimer:
    """forward+backward and forward time of one optimizer step: CUDA events on a GPU, the host clock elsewhere.

    Without host synchronisation the host returns from a micro-batch long before the GPU has run it, so TRL's host
    clock (`perf/fwd_bwd_s`, `perf/fwd_s`) would time kernel launches. On a GPU `perf/fwd_bwd_s` becomes the GPU
    span from the step's first forward to its last backward (the gaps between micro-batches included) and
    `perf/fwd_s` the sum of the forwards' GPU spans; both are read once per step, after the last backward.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._first: Any = None
        self._last: Any = None
        self._forwards: list[tuple[Any, Any]] = []

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def microbatch_begin(self) -> None:
        if self.cuda and self._first is None:
            self._first = self._event()

    def microbatch_end(self) -> None:
        if self.cuda:
            self._last = self._event()

    def forward(self) -> Any:
        return self._event() if self.cuda else time.perf_counter()

    def forward_done(self, started: Any) -> float:
        """Host seconds of the forward (what TRL logs on CPU); on a GPU the pair is kept for `read`."""
        if self.cuda:
            self._forwards.append((started, self._event()))
            return 0.0
        return time.perf_counter() - started

    def read(self) -> tuple[float, float] | None:
        """(forward+backward s, forward s) of the step on the GPU, then reset; None off the GPU or with no step."""
        first, last, forwards = self._first, self._last, self._forwards
        self._first, self._last, self._forwards = None, None, []
        if not self.cuda or first is None or last is None:
            return None
        last.synchronize()
        return first.elapsed_time(last) / 1e3, sum(a.elapsed_time(b) for a, b in forwards) / 1e3


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


# --- prefetching ---------------------------------------------------------------------------------------------------


@dataclass
class StepVersions:
    """The policy version each micro-batch will be trained at, for the staleness check of samples packed ahead.

    TRL syncs (and bumps `model_version`) at the end of every `weight_sync_steps`-th step; micro-batch b of a run
    that started at step g0 with version v0 is trained in step s = g0 + b // GA + 1, at version
    v0 + (s - 1) // weight_sync_steps - g0 // weight_sync_steps. Never below the trainer's current version.
    """

    gradient_accumulation_steps: int
    weight_sync_steps: int
    start_step: int = 0
    start_version: int = 0

    def at(self, batch_index: int, current: int) -> int:
        steps_before = self.start_step + batch_index // self.gradient_accumulation_steps
        syncs = steps_before // self.weight_sync_steps - self.start_step // self.weight_sync_steps
        return max(current, self.start_version + syncs)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class MicroBatchStream:
    """One rank's micro-batches as TRL's dataloader makes them (planner -> collator), optionally packed on a thread.

    `bind(planner, collate)`: `planner` yields one micro-batch's rows at a time (TRL's TokenBudgetBatcher or
    FixedCountBatcher, built with `self.sink` as its metric sink), `collate` is TRL's DataCollatorForRollout built
    with `self.sink` and `self.groups`. Each micro-batch is handed over with the metrics and prompt groups its
    packing produced, to `deliver(metrics, groups)`, when the training loop takes it: so these land in the step
    that trains the micro-batch, as they do in TRL. With `threaded`, packing runs `depth` micro-batches ahead on a
    daemon thread; `wait_s` is then the time the training loop waited for a micro-batch (TRL's
    `perf/rollout_wait_s`). `prepare` runs on the packing side (e.g. `compact_batch`), then tensors are pinned
    (`pin`) and copied to `device` without blocking when taken.
    """

    def __init__(self, *, deliver: Callable[[dict[str, list], set], None], prepare: Callable[[Any], Any] | None = None,
                 threaded: bool = False, depth: int = 1, device: Any = None, pin: bool = False,
                 on_start: Callable[[], None] | None = None, switch_interval_s: float = 0.0) -> None:
        self.sink: dict[str, list] = defaultdict(list)
        self.groups: set[Any] = set()
        self.building = 0  # index of the micro-batch being packed (read by the staleness check)
        self.wait_s = 0.0
        self.deliver, self.prepare, self.threaded, self.depth = deliver, prepare, threaded, max(1, depth)
        self.device, self.pin, self.on_start = device, pin, on_start
        self.switch_interval_s = switch_interval_s
        self.process: PackingProcess | None = None  # set: packing runs in that process instead
        self._planner: Iterable[Any] | None = None
        self._collate: Callable[[list[Any]], Any] | None = None

    def bind(self, planner: Iterable[Any], collate: Callable[[list[Any]], Any]) -> None:
        self._planner, self._collate = planner, collate

    def _packed(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        assert self._planner is not None and self._collate is not None, "bind() the planner and collator first"
        for rows in self._planner:
            batch = self._collate([rows])
            if self.prepare is not None:
                batch = self.prepare(batch)
            if self.pin:
                batch = _map_tensors(batch, lambda tensor: tensor.pin_memory())
            metrics = {key: list(values) for key, values in self.sink.items() if values}
            self.sink.clear()
            groups = set(self.groups)
            self.groups.clear()
            self.building += 1
            yield batch, metrics, groups

    def _to_device(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return _map_tensors(batch, lambda tensor: tensor.to(self.device, non_blocking=True))

    def __iter__(self) -> Iterator[Any]:
        if self.on_start is not None:
            self.on_start()
        if self.process is not None:
            items = self._in_process()
        else:
            items = self._threaded() if self.threaded else self._packed()
        for batch, metrics, groups in items:
            self.deliver(metrics, groups)
            yield self._to_device(batch)

    def _threaded(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        handoff: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.2)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                for item in self._packed():
                    if not put(item):
                        return
            except BaseException as exc:  # handed to the training loop, which raises it
                put(_Failure(exc))
            else:
                put(_END)

        thread = threading.Thread(target=work, name="lorafleet-prefetch", daemon=True)
        interval = sys.getswitchinterval()
        if self.switch_interval_s > 0:
            sys.setswitchinterval(self.switch_interval_s)
        thread.start()
        try:
            while True:
                started = time.perf_counter()
                while True:
                    try:
                        item = handoff.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if not thread.is_alive() and handoff.empty():
                            raise RuntimeError("the prefetch thread ended without a micro-batch or an error") from None
                self.wait_s += time.perf_counter() - started
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            sys.setswitchinterval(interval)


    def _in_process(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        """Micro-batches packed by `self.process` (see `PackingProcess`), pinned here, `wait_s` as with a thread."""
        spec = self.process
        assert spec is not None
        spec.start()
        try:
            while True:
                started = time.perf_counter()
                item = spec.get()
                self.wait_s += time.perf_counter() - started
                if item is _END:
                    return
                batch, metrics, groups = item
                if self.pin:
                    batch = _map_tensors(batch, lambda tensor: tensor.pin_memory())
                yield batch, metrics, groups
        finally:
            spec.stop()


@dataclass
class PackingProcess:
    """TRL's planner and collator (and `compact_batch`) in a spawned process, reading TRL's rollout queue directly.

    The process builds the same RolloutQueueDataset -> TokenBudgetBatcher / FixedCountBatcher -> collator chain as
    TRL on one rank, with its own metric sink and group set, and sends each micro-batch (tensors as numpy arrays)
    with its metrics and groups; its staleness check is `StepVersions` against the rollout worker's shared version.
    The training process keeps the health check (`idle_check`, every `poll_s` without a micro-batch) and raises
    what the process raised. Rollout traces (report_to) are not logged from there.
    """

    rollout_queue: Any
    version_value: Any  # the rollout worker's shared mp.Value of the policy version
    versions: StepVersions
    pad_token_id: int
    token_budget: int
    batch_size: int
    max_staleness: int
    compact: bool
    depth: int
    idle_check: Callable[[], None] = lambda: None
    poll_s: float = 5.0
    context: Any = None

    def start(self) -> None:
        import multiprocessing
        import multiprocessing.util
        import os

        ctx = self.context or multiprocessing.get_context("spawn")
        self._out = ctx.Queue(maxsize=max(1, self.depth))
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_pack_in_process, name="lorafleet-packer", daemon=True, args=(
            {"rollout_queue": self.rollout_queue, "version_value": self.version_value, "versions": self.versions,
             "pad_token_id": self.pad_token_id, "token_budget": self.token_budget, "batch_size": self.batch_size,
             "max_staleness": self.max_staleness, "compact": self.compact, "parent": os.getpid()},
            self._out, self._stop))
        self._proc.start()
        # At interpreter exit multiprocessing terminates daemonic children (SIGTERM, which the packer ignores) and
        # joins them: stop it first. Finalizers run before that; the training loop may never close the stream.
        multiprocessing.util.Finalize(self, self.stop, exitpriority=10)

    def get(self) -> Any:
        while True:
            try:
                kind, payload = self._out.get(timeout=self.poll_s)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the packing process exited ({self._proc.exitcode}) without an error "
                                       "message") from None
                self.idle_check()
                continue
            if kind == "error":
                raise payload
            if kind == "end":
                return _END
            arrays, metrics, groups = payload
            return _map_arrays(arrays), metrics, groups

    def stop(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        self._proc = None
        self._stop.set()
        proc.join(timeout=2)
        if proc.is_alive():  # blocked on the rollout queue: it holds nothing the trainer still needs
            proc.kill()
            proc.join(timeout=2)


def _to_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.numpy())
    if isinstance(value, dict):
        return {key: _to_arrays(item) for key, item in value.items()}
    return value


def _map_arrays(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
        return torch.from_numpy(value[1])
    if isinstance(value, dict):
        return {key: _map_arrays(item) for key, item in value.items()}
    return value


def _pack_in_process(spec: dict[str, Any], out: Any, stop: Any) -> None:
    """The packing process: TRL's one-rank dataloader chain, each micro-batch sent to `out` (see PackingProcess)."""
    import signal

    from lorafleet_trainer.ranks import die_with_parent

    die_with_parent(spec["parent"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when training stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)

    def send(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    try:
        from accelerate import PartialState
        from trl.experimental.async_grpo.async_grpo_trainer import (
            DataCollatorForRollout,
            FixedCountBatcher,
            RolloutQueueDataset,
            TokenBudgetBatcher,
        )

        PartialState(cpu=True)  # TRL logs through accelerate, which needs a state; one process, no GPU
        stream = MicroBatchStream(deliver=lambda *_: None, prepare=compact_batch if spec["compact"] else None)
        versions, value = spec["versions"], spec["version_value"]
        samples = RolloutQueueDataset(
            rollout_queue=spec["rollout_queue"],
            model_version_fn=lambda: versions.at(stream.building, int(value.value)),
            check_health_fn=lambda _stale_after_s: None,  # the training process checks the rollout worker
            stale_after_s=0.0,
            metrics=stream.sink,
            max_staleness=spec["max_staleness"],
            report_to=[],
        )
        budget = spec["token_budget"]
        planner: Any = (TokenBudgetBatcher(samples, 1, budget, stream.sink) if budget > 0
                        else FixedCountBatcher(samples, 1, spec["batch_size"]))
        stream.bind(planner, DataCollatorForRollout(spec["pad_token_id"], 1, groups_trained=stream.groups,
                                                    metrics=stream.sink, token_budget=max(budget, 0)))
        for batch, metrics, groups in stream._packed():
            if not send(("batch", (_to_arrays(batch), metrics, groups))):
                return
    except BaseException as exc:  # sent to the training process, which raises it
        try:
            send(("error", exc))
        except Exception:  # unpicklable: its text then
            send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    else:
        send(("end", None))


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value
