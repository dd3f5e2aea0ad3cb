"""The trainer's real speed: lorafleet-train's AsyncGRPOTrainer at the published run's shape, side by side.

`make bench-trainer` (an H200 or any CUDA GPU) runs the project's own trainer path: settings with the `math`
recipe's defaults (G=8, LoRA r=1 alpha 2 all-linear, token budget 16,384 x 6 accumulation steps, completions up
to 3,000 tokens), `build_configs`, the attention backend choice, `build_trainer` (TRL 1.16's AsyncGRPOTrainer +
PEFT, and lorafleet's fast step: lorafleet_trainer/fast_step/), bf16 mixed precision, on the Qwen2.5-Math-1.5B
architecture (`trainer_shape.QWEN25_MATH_1_5B`, config written offline, random weights: no Hub). Generation is
`vllm_standin.py`, a test double speaking the vLLM routes TRL calls that answers at once, so the figures are the
trainer's alone, never starved by generation.

The configurations are the fast step's levers side by side: TRL's own step (`trl-step`), each lever alone
(`prefetch`, `sync-free`, `liger`, `fused-lora`), all of them (`fast`, the default), and variants (packing on a
thread, without prefetching or the fused LoRA path, other micro-batch sizes). Each runs in its own
process (a clean CUDA context and peak-memory counter): warm-up steps, timed steps, then (where `profiled`) one
step under the torch profiler. First, `--equivalence` (on by default on a GPU) compares the fast path's loss,
LoRA gradients and metrics with TRL's on one fixed 16,384-token micro-batch (lorafleet_trainer/step_check.py).
Results go to `--out` (JSON) as each part finishes; `--table FILE` prints the README's tables from such a JSON.
`--tiny` is the same path on CPU at a tiny shape (tests/integration/test_trainer_bench_e2e.py runs it).

MFU is TRL's formula (`perf/mfu_fwd_bwd`): forwarded tokens per second of forward+backward x
`compute_flops_per_token` (3 x forward FLOPs: 2 x (QKV + O + MLP + 2 x heads x head_dim x mean sequence length)
per layer, plus the LM head's 2 x vocab x hidden) / 989 TFLOP/s (TRL's dense bf16 peak of an H200). TRL times
forward+backward on the host (`perf/fwd_bwd_s`), which misses GPU work still queued when a micro-batch returns,
and without host synchronisation would time kernel launches only; so every configuration is also timed on the
GPU (CUDA events from the step's first forward to its last backward: `fwd_bwd_gpu_s`), and its MFU by TRL's formula
on that time (`mfu_gpu`) is the figure the goals are judged by.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lorafleet.ports import free_port
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from trainer_shape import build_workload  # a sibling: Python puts bench/ first on sys.path

HERE = Path(__file__).resolve().parent

REFERENCE = {"fwd_bwd_s": 4.6, "step_s": 4.8, "mfu_fwd_bwd": 23.5, "source": "published reference deployment, run 5"}
# issue 35: at the reference shape on one H200, without gradient checkpointing
GOALS = {"step_s": 2.4, "fwd_bwd_s": 2.0, "mfu_fwd_bwd": 46.0, "peak_gib_without_checkpointing": 60.0}
GIB = 1024**3


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the trainer, as settings (the names lorafleet-train reads), the fast step's levers
    (lorafleet_trainer.fast_step.options.StepOptions) and the bench's step counts."""

    name: str
    attention: str = "builtin"
    gradient_checkpointing: bool = False
    token_budget: int = 16384
    gradient_accumulation_steps: int = 6
    model_dtype: str = ""  # "" = what build_configs chooses; "float32" = the frozen base in float32 (TRL's default)
    peft_input_casts: bool = False  # True = PEFT's own float32 copy of every LoRA layer's input (before lorafleet)
    prefetch: bool = False
    sync_free_loss: bool = False
    fused_lora: bool = False
    liger: bool = False
    packing: str = "process"
    switch_interval_s: float = 0.0
    warmup_steps: int = 2
    timed_steps: int = 4
    profiled: bool = False

    def settings(self) -> dict[str, Any]:
        return {"trainer_attention": self.attention, "gradient_checkpointing": self.gradient_checkpointing,
                "token_budget": self.token_budget, "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def step(self) -> Any:
        from lorafleet_trainer.fast_step.options import StepOptions

        return StepOptions(prefetch=self.prefetch, sync_free_loss=self.sync_free_loss, fused_lora=self.fused_lora,
                           liger=self.liger, packing=self.packing, switch_interval_s=self.switch_interval_s)


# Same tokens per optimizer step in every row (16,384 x 6 = 98,304, the reference's budget) except where the
# micro-batch itself is what is compared. `trl-step` is TRL's own step (the default before issue 35), `fast` every
# lever (the default now: TRAINER_FAST_STEP=true).
FAST_LEVERS = {"prefetch": True, "sync_free_loss": True, "fused_lora": True, "liger": True}
CONFIGS = [
    BenchConfig("trl-step", profiled=True),
    BenchConfig("fast", **FAST_LEVERS, profiled=True),
    BenchConfig("prefetch", prefetch=True),
    BenchConfig("sync-free", sync_free_loss=True),
    BenchConfig("liger", liger=True),
    BenchConfig("fused-lora", fused_lora=True),
    BenchConfig("fast-thread", **FAST_LEVERS, packing="thread"),
    BenchConfig("fast-switch-0.5ms", **FAST_LEVERS, packing="thread", switch_interval_s=0.0005),
    BenchConfig("fast-no-prefetch", **{**FAST_LEVERS, "prefetch": False}),
    BenchConfig("fast-no-fused-lora", **{**FAST_LEVERS, "fused_lora": False}),
    BenchConfig("fast-24k", **FAST_LEVERS, token_budget=24576, gradient_accumulation_steps=4),
    BenchConfig("fast-32k", **FAST_LEVERS, token_budget=32768, gradient_accumulation_steps=3),
]
# On CPU: the fast step's levers that need no GPU (Liger's kernels are Triton), and TRL's own step by name.
TINY_BENCH = {"attention": "torch", "token_budget": 1024, "gradient_accumulation_steps": 2, "warmup_steps": 1,
        "timed_steps": 2}
TINY_CONFIGS = [BenchConfig("tiny", prefetch=True, sync_free_loss=True, fused_lora=True, **TINY_BENCH)]
TINY_EXTRA = [BenchConfig("tiny-trl-step", **TINY_BENCH)]


# --- the workload: model, tokenizer, prompts --------------------------------------------------------------------


def start_standin(workload: dict[str, Any], tiny: bool) -> tuple[subprocess.Popen, str]:
    """The stand-in vLLM server in its own process (off the trainer's interpreter lock); waits for /health."""
    import requests

    port = free_port()
    command = [sys.executable, str(HERE / "vllm_standin.py"), "--port", str(port), "--model", workload["model_dir"],
               "--token-ids", str(workload["token_ids"]), "--eos", str(workload["eos"]),
               "--model-vocab", str(workload["model_vocab"]), *(["--tiny"] if tiny else [])]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM stand-in exited with {process.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except requests.RequestException:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the vLLM stand-in did not answer /health within 60 s")


# --- one configuration, in its own process ----------------------------------------------------------------------


class StepClock:
    """A TrainerCallback: GPU-synchronised step times, peak memory after the timed steps, and a profile of one step.

    Given to the trainer before TRL's own callbacks, so a step ends here before TRL's weight sync runs.
    """

    def __init__(self, config: BenchConfig, cuda: bool) -> None:
        self.config, self.cuda = config, cuda
        self.started = 0.0
        self.step_s: list[float] = []
        self.fwd_bwd_gpu_s: dict[int, float] = {}  # step -> GPU span of its forwards and backwards
        self._span: list[Any] = []  # [first event, last event] of the step in progress
        self.peak_gib: float | None = None
        self.reserved_gib: float | None = None
        self.profile: dict[str, Any] | None = None
        self._profiler: Any = None
        self.trainer: Any = None

    def _sync(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _last_timed(self) -> int:
        return self.config.warmup_steps + self.config.timed_steps

    def time_microbatches(self, trainer: Any) -> None:
        """CUDA events around each `training_step` (forward + backward of one micro-batch) of `trainer`."""
        if not self.cuda:
            return
        import torch

        inner = trainer.training_step
        clock = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if not clock._span:
                clock._span.append(torch.cuda.Event(enable_timing=True))
                clock._span[0].record()
            out = inner(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            clock._span[1:] = [end]
            return out

        trainer.training_step = training_step

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                step = state.global_step + 1
                if step == clock._last_timed() + 1 and clock.config.profiled and clock.cuda:
                    clock._start_profiler()
                clock.started = clock._sync()

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                elapsed = clock._sync() - clock.started
                step = state.global_step
                if len(clock._span) == 2:
                    clock.fwd_bwd_gpu_s[step] = clock._span[0].elapsed_time(clock._span[1]) / 1e3
                clock._span = []
                if clock.config.warmup_steps < step <= clock._last_timed():
                    clock.step_s.append(elapsed)
                if step == clock._last_timed() and clock.cuda:
                    import torch

                    clock.peak_gib = torch.cuda.max_memory_allocated() / GIB
                    clock.reserved_gib = torch.cuda.max_memory_reserved() / GIB
                if clock._profiler is not None:
                    clock._stop_profiler(elapsed)

            def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                # Measuring is over: ask the rollout child to stop and drain the sample queue it may be blocked
                # on, so that TRL's stop() finds it gone instead of waiting 15 s before terminating it.
                worker = getattr(clock.trainer, "rollout_worker", None)
                process = getattr(worker, "_process", None)
                if process is None:
                    return
                worker._stop_event_mp.set()
                deadline = time.monotonic() + 10
                while process.is_alive() and time.monotonic() < deadline:
                    with contextlib.suppress(queue.Empty):
                        worker.rollout_buffer.get(timeout=0.1)

        return _Callback()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
        self._profiler.__enter__()

    def _stop_profiler(self, wall_s: float) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.profile = summarize_profile(profiler.events(), wall_s)


MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_grouped_mm"}
MOVES = {"aten::copy_", "aten::_to_copy", "aten::index_select", "aten::index", "aten::gather", "aten::scatter",
         "aten::scatter_add_", "aten::cat", "aten::masked_scatter", "aten::nonzero", "aten::index_put_",
         "aten::index_add_", "aten::clone", "aten::embedding_dense_backward", "aten::embedding"}
ATTENTION_WORDS = ("attn", "attention", "flash", "varlen")


def _category(event: Any, rank: int) -> str:
    """Where one CPU-side op's own GPU time goes (its own kernels, not its children's)."""
    ancestors, parent = [], event.cpu_parent
    while parent is not None:
        ancestors.append(parent.name)
        parent = parent.cpu_parent
    if any(name.startswith(("Optimizer.step", "Optimizer.zero_grad")) for name in ancestors):
        return "optimizer"
    name = event.name
    lowered = [name.lower(), *(ancestor.lower() for ancestor in ancestors)]
    if any(word in text for text in lowered for word in ATTENTION_WORDS):
        return "attention"
    if name in MATMULS:
        shapes = [shape for shape in (event.input_shapes or []) if shape]
        if any(rank in shape[-2:] for shape in shapes):
            return "lora_matmul"
        return "base_and_head_matmul"
    if name in MOVES or name.startswith(("cudaMemcpy", "cudaMemset", "Memcpy", "Memset")):
        return "data_movement"
    return "other"  # elementwise work, norms, and Triton kernels such as TRL's fused log-probabilities


def summarize_profile(events: Any, wall_s: float, rank: int = 1) -> dict[str, Any]:
    """Shares of one profiled step's GPU time by category, and the GPU's busy share of the step's wall time."""
    from torch.autograd import DeviceType

    device_us: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type != DeviceType.CPU or event.self_device_time_total <= 0:
            continue
        device_us[_category(event, rank)] += event.self_device_time_total
    busy_s = sum(device_us.values()) / 1e6
    return {
        "wall_s": round(wall_s, 3),
        "gpu_busy_s": round(busy_s, 3),
        "gpu_idle_share": round(max(0.0, 1 - busy_s / wall_s), 3) if wall_s else None,
        "share_of_gpu_time": {key: round(value / 1e6 / busy_s, 3) for key, value in
                              sorted(device_us.items(), key=lambda item: -item[1])} if busy_s else {},
    }


def _stats(values: list[float]) -> dict[str, float] | None:
    values = sorted(value for value in values if value is not None)
    if not values:
        return None
    p90 = values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]
    return {"median": round(statistics.median(values), 4), "p90": round(p90, 4), "n": len(values)}


def timed_rows(metrics_path: Path, first: int, last: int) -> list[dict[str, Any]]:
    """TRL's own per-step metrics (metrics.jsonl, one line per step) of steps first..last."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [row for row in rows if first <= row.get("step", 0) <= last and "perf/fwd_bwd_s" in row]


def gpu_timing(rows: list[dict[str, Any]], fwd_bwd_gpu_s: dict[int, float]) -> dict[str, Any]:
    """forward+backward timed on the GPU per step, and MFU by TRL's formula on that time.

    TRL's MFU is linear in 1 / fwd_bwd_s, so the GPU-timed MFU of a step is perf/mfu_fwd_bwd x perf/fwd_bwd_s /
    its GPU time: TRL's own FLOP count and peak, with the time measured on the GPU.
    """
    spans, mfus = [], []
    for row in rows:
        span = fwd_bwd_gpu_s.get(row["step"])
        if span is None:
            continue
        spans.append(span)
        if isinstance(row.get("perf/mfu_fwd_bwd"), int | float) and span > 0:
            mfus.append(row["perf/mfu_fwd_bwd"] * row["perf/fwd_bwd_s"] / span)
    return {"fwd_bwd_gpu_s": _stats(spans), "mfu_gpu": _stats(mfus)}


def step_metrics(metrics_path: Path, first: int, last: int) -> dict[str, Any]:
    """TRL's own per-step metrics (metrics.jsonl, one line per step) over steps first..last."""
    rows = timed_rows(metrics_path, first, last)
    keys = ("perf/step_s", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
            "perf/mfu_fwd_bwd", "perf/mfu_wall_clock", "perf/trained_tok_s_wall_clock",
            "perf/forwarded_tok_s_fwd_bwd", "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step",
            "batch/samples_per_step", "batch/samples_per_row", "batch/microbatches_per_step", "batch/row_fill_frac",
            "ratio")
    out = {key: _stats([row[key] for row in rows if isinstance(row.get(key), int | float)]) for key in keys}
    every = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    sync_keys = ("perf/weight_sync_s", "perf/weight_sync_transfer_s")
    out.update({key: _stats([row[key] for row in every if isinstance(row.get(key), int | float)]) for key in sync_keys})
    return out


def run_one(config: BenchConfig, workload: dict[str, Any], url: str, work: Path, tiny: bool) -> dict[str, Any]:
    """Train `config` for warm-up + timed (+ profiled) steps through lorafleet-train's own building blocks."""
    import torch
    from lorafleet_trainer.attention import choose_backend
    from lorafleet_trainer.config import build_configs
    from lorafleet_trainer.main import build_trainer, install_kernels, resolve_settings
    from lorafleet_trainer.ranks import plan_ranks
    from lorafleet_trainer.run_state import MetricsJsonl
    from trl.experimental.async_grpo import async_rollout_worker

    # The generation side is the stand-in, reached over HTTP only: TRL's worker needs no vLLM installed for that.
    async_rollout_worker.is_vllm_available = lambda *_: True
    steps = config.warmup_steps + config.timed_steps + (1 if config.profiled else 0)
    overrides = {
        "trainer_task": "math", "base_model": workload["model_dir"], "dataset_path": workload["dataset"],
        "adapter_root": str(work / "adapters"), "run_name": config.name, "trainer_vllm_url": url,
        "trainer_replicas": 1, "max_steps": steps, "save_steps": 100_000, "trainer_resume": False,
        "trainer_metrics_port": 0, "trainer_report_to": "none", **config.settings(),
    }
    if tiny:
        overrides.update({"max_completion_length": 24, "num_generations": 4, "max_inflight_per_replica": 16,
                          "weight_sync_steps": 2, "trainer_cpu_threads": 1})
    settings = resolve_settings(overrides)
    cuda = torch.cuda.is_available()
    backend = choose_backend(settings.trainer_attention, cuda=cuda).backend
    configs = build_configs(settings, replicas=1, ranks=plan_ranks(settings, torch.cuda.device_count()))
    if config.model_dtype:
        configs.grpo.dtype = config.model_dtype
    install_kernels(settings, backend, cuda=cuda)
    clock = StepClock(config, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(settings, configs, [MetricsJsonl(settings.metrics_path), clock.callback()],
                            step=config.step())
    clock.trainer = trainer
    clock.time_microbatches(trainer)
    if config.peft_input_casts:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in trainer.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = True
    started = time.perf_counter()
    trainer.train()
    first, last = config.warmup_steps + 1, config.warmup_steps + config.timed_steps
    trl = step_metrics(settings.metrics_path, first, last)
    return {
        **asdict(config), "backend": backend, "bf16": configs.grpo.bf16, "model_dtype": configs.grpo.dtype,
        "step_applied": trainer.lorafleet_step.summary(), "trainer_class": type(trainer).__name__,
        "tokens_per_step": config.token_budget * config.gradient_accumulation_steps,
        "trainer_step_s": _stats(clock.step_s), "peak_gib": clock.peak_gib, "reserved_gib": clock.reserved_gib,
        **gpu_timing(timed_rows(settings.metrics_path, first, last), clock.fwd_bwd_gpu_s),
        "trl": trl, "profile": clock.profile, "train_wall_s": round(time.perf_counter() - started, 1),
    }


# --- the whole benchmark ----------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """The shared run record (lorafleet_ops.docsite.record), plus the flat fields `table` prints from."""
    record = run_record()
    versions, gpus = record["versions"], record["machine"]["gpus"]
    return {RECORD_KEY: record, "gpu": gpus[0] if gpus else None, "python": versions["python"],
            **{name: versions.get(name) for name in ("torch", "transformers", "trl", "peft", "accelerate")},
            "liger_kernel": versions.get("liger-kernel")}


# --- the fast step computes TRL's loss: one fixed micro-batch through both paths ---------------------------------


def equivalence(workload: dict[str, Any], tiny: bool) -> dict[str, Any]:
    """TRL's loss vs the fast step's (sync-free loss, then + fused LoRA, then + Liger on a GPU) on one micro-batch.

    The benchmark's model (random weights, bf16 under autocast on a GPU; float32 on CPU) as TRL builds it, LoRA r=1
    all-linear with random B (PEFT starts B at zero, where A gets no gradient), one 8,192-token micro-batch of
    groups of 8 rollouts packed by TRL. `plain_vs_plain` is TRL's path against itself (GPU noise). On a GPU the
    exact loss is the same model in float32: the fast step passes when it is as close to it as TRL's own bf16 step
    (`verdict`); on CPU (float32 throughout) when it equals TRL's to float32 precision.
    """
    import torch
    from lorafleet_trainer.attention import install
    from lorafleet_trainer.lora_precision import autocast_adapter_inputs
    from lorafleet_trainer.step_check import CheckBatch, build_batch, compare_paths, run_plain
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention
    from trl.trainer.utils import add_fused_lm_head

    cuda = torch.cuda.is_available()
    install("builtin" if cuda else "torch")
    register_tree_attention()
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(workload["model_dir"], dtype=dtype, attn_implementation=TREE_ATTENTION)
    model = model.to("cuda" if cuda else "cpu")
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0,
                                             bias="none", task_type="CAUSAL_LM"))
    autocast_adapter_inputs(model)
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_((torch.randn(param.shape, generator=generator) * 0.01).to(param.device))
    spec = (CheckBatch(vocab=workload["token_ids"], token_budget=1024, group_size=4, prompt_tokens=(8, 40),
                       completion_tokens=(4, 120)) if tiny else
            # 8,192 tokens: the float32 reference runs the pure-PyTorch attention kernel, whose memory is quadratic
            CheckBatch(vocab=workload["model_vocab"], token_budget=8192, group_size=8, prompt_tokens=(40, 160),
                       completion_tokens=(100, 1500)))
    batch = build_batch(spec)
    reference = None
    if cuda:  # the exact loss: the same model in float32 (the pure-PyTorch attention kernel; no autocast)
        frozen = [param for param in model.parameters() if not param.requires_grad and param.dtype == dtype]
        for param in frozen:
            param.data = param.data.float()
        install("torch")
        reference = run_plain(model, batch, device=torch.device("cuda"), autocast=None)
        for param in frozen:
            param.data = param.data.to(dtype)  # exact: the weights were bf16
        install("builtin")
        torch.cuda.empty_cache()
    report = compare_paths(model, batch, fused_lora=True, liger=cuda, autocast=torch.bfloat16 if cuda else None,
                           reference=reference)
    report.update(verdict(report))
    report["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    report["dtype"] = "bf16 weights, bf16 autocast" if cuda else "float32"
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Pass or not, and by which rule: on a GPU against the float32 loss, on CPU against TRL's float32 path."""
    last = report["fast_vs_plain"]
    bookkeeping = last["same_metric_keys"] and last["same_accounting"]
    if "vs_float32" not in report:
        rule = {"rule": "fast vs TRL (both float32): loss within 1e-5 relative, gradient cosine >= 1 - 1e-6"}
        return {"tolerance": rule, "passed": bool(bookkeeping and last["loss_rel"] <= 1e-5
                                                  and (last["grad_cosine"] or 0) >= 1 - 1e-6)}
    exact = report["vs_float32"]
    trl, fast = exact["TRL's step"], exact[list(exact)[-1]]
    # as close to the float32 loss and gradient as TRL's bf16 step, with a factor 2 of slack (one more rounding)
    loss_ok = fast["loss_abs"] <= 2 * trl["loss_abs"] + 1e-6
    grad_ok = 1 - fast["grad_cosine"] <= 2 * (1 - trl["grad_cosine"]) + 1e-4
    rule = {"rule": "against the float32 loss: |loss error| <= 2 x TRL bf16's + 1e-6, (1 - gradient cosine) <= "
                    "2 x TRL bf16's + 1e-4"}
    return {"tolerance": rule, "passed": bool(bookkeeping and loss_ok and grad_ok)}


def run_equivalence(workload: dict[str, Any], work: Path, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """`equivalence` in its own process (its own CUDA context, before the configurations)."""
    result_file = work / "equivalence.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--one-equivalence", "--work", str(work),
               "--result", str(result_file), *(["--tiny"] if args.tiny else [])]
    try:
        code = subprocess.run(command, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = f"killed at the {timeout:.0f} s limit"
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"error": f"exit code {code}"}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    workload = build_workload(work, args.tiny)
    (work / "workload.json").write_text(json.dumps(workload))
    configs = TINY_CONFIGS if args.tiny else CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        known = {config.name: config for config in [*configs, *(TINY_EXTRA if args.tiny else [])]}
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise SystemExit(f"trainer_bench: unknown configuration(s) {unknown}; known: {sorted(known)}")
        configs = [known[name] for name in wanted]
    overrides = json.loads(args.set) if args.set else {}
    configs = [replace(config, **overrides) for config in configs]
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/trainer_bench.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **environment(),
        "shape": {**workload["shape"], "lora": "r=1 alpha=2 all-linear", "num_generations": 8,
                  "max_completion_length": 24 if args.tiny else 3000, "precision": "bf16 mixed",
                  "generation": "stand-in (bench/vllm_standin.py): no model runs; random tokens at published lengths"},
        "reference": REFERENCE, "goals": GOALS, "configs": [],
    }
    out = Path(args.out)
    deadline = time.monotonic() + args.budget_s
    if args.equivalence == "on" or (args.equivalence == "auto" and not args.tiny):
        report["equivalence"] = run_equivalence(workload, work, args, min(args.config_timeout, args.budget_s))
        write_result(out, report)
        print(f"[bench-trainer] equivalence: {equivalence_line(report['equivalence'])}", flush=True)
    for config in configs:
        remaining = deadline - time.monotonic()
        if remaining < 60:
            result = {**asdict(config), "error": f"skipped: the run's --budget-s {args.budget_s:.0f} was spent"}
        else:
            result = run_config(config, workload, work, args, min(args.config_timeout, remaining))
        report["configs"].append(result)
        write_result(out, report)
        print(f"[bench-trainer] {config.name}: {summary_line(result)}", flush=True)
    return report


def run_config(config: BenchConfig, workload: dict[str, Any], work: Path, args: argparse.Namespace,
               timeout: float) -> dict[str, Any]:
    """One configuration in its own process group, against its own fresh stand-in (TRL numbers adapters from v1)."""
    import signal

    result_file = work / f"{config.name}.json"
    result_file.unlink(missing_ok=True)
    shutil.rmtree(work / "adapters" / "runs" / config.name, ignore_errors=True)  # metrics.jsonl appends
    started = time.perf_counter()
    standin, url = start_standin(workload, args.tiny)
    command = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(asdict(config)),
               "--work", str(work), "--standin", url, "--result", str(result_file), *(["--tiny"] if args.tiny else [])]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        code: int | str = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the trainer and its rollout child
        process.wait()
        code = f"killed at the {timeout:.0f} s limit"
    finally:
        standin.terminate()
        standin.wait(timeout=10)
    wall_s = round(time.perf_counter() - started, 1)
    if result_file.exists():
        return {**json.loads(result_file.read_text()), "process_wall_s": wall_s}
    return {**asdict(config), "error": f"exit code {code} after {wall_s:.0f} s"}


def summary_line(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"FAILED ({result['error']})"
    trl = result["trl"]
    return (f"fwd+bwd {_med(result, 'fwd_bwd_gpu_s')} s on the GPU ({_med(trl, 'perf/fwd_bwd_s')} s TRL), "
            f"step {_med(trl, 'perf/step_s')} s, MFU {_med(result, 'mfu_gpu')}% ({_med(trl, 'perf/mfu_fwd_bwd')}% "
            f"TRL), peak {result['peak_gib'] and round(result['peak_gib'], 1)} GiB, "
            f"levers {result.get('step_applied')}")


def equivalence_line(check: dict[str, Any]) -> str:
    if "error" in check:
        return f"FAILED ({check['error']})"
    last = check["fast_vs_plain"]
    verdict = "passed" if check["passed"] else "NOT passed"
    return (f"{verdict}: loss {check['loss_plain']:.6g} vs {check['loss_fast']:.6g}"
            f" (rel {last['loss_rel']:.1e}), gradient cosine {last['grad_cosine']:.6f}; TRL vs itself: rel "
            f"{check['plain_vs_plain']['loss_rel']:.1e}, cosine {check['plain_vs_plain']['grad_cosine']:.6f}")


def _med(trl: dict[str, Any], key: str) -> Any:
    value = (trl.get(key) or {}).get("median")
    return None if value is None else round(value, 3 if "mfu" not in key else 1)


def _p90(trl: dict[str, Any], key: str) -> Any:
    value = (trl.get(key) or {}).get("p90")
    return None if value is None else round(value, 3)


LEVER_NAMES = {"prefetch": "prefetch", "sync_free_loss": "sync-free loss", "liger": "Liger",
               "fused_lora": "fused LoRA"}


def _levers(result: dict[str, Any]) -> str:
    applied = result.get("step_applied") or {key: result.get(key) for key in LEVER_NAMES}
    names = [name for key, name in LEVER_NAMES.items() if applied.get(key)]
    if applied.get("prefetch"):  # results from before the packing process name no packing: a thread then
        where = applied.get("packing") or "thread"
        switch = f", switch {applied['switch_interval_s'] * 1e3:g} ms" if applied.get("switch_interval_s") else ""
        names[0] = f"prefetch ({where}{switch})"
    return " + ".join(names) if names else "none (TRL's step)"


def table(report: dict[str, Any]) -> str:
    """The tables printed after a run (and by --table), from the JSON: the configurations, the profiles, the
    equivalence check. The docs page renders the same JSON itself."""
    liger = f", Liger-Kernel {report['liger_kernel']}" if report.get("liger_kernel") else ""
    lines = [
        f"`{report['command']}` on {report['gpu']}, {report['date']} (torch {report['torch']}, transformers "
        f"{report['transformers']}, TRL {report['trl']}, PEFT {report['peft']}{liger}). Generation: the stand-in, "
        "not vLLM.",
        "",
        "| configuration | attention | grad. ckpt | fast-step levers | tokens/micro-batch x steps | fwd+bwd s, "
        "GPU-timed (median) | fwd+bwd s, TRL's clock | step s (median / p90) | trained tok/s | MFU % by TRL's "
        "formula: GPU-timed / TRL's clock | peak GiB | adapter publish s (save) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in report["configs"]:
        tokens = f"{result['token_budget']:,} x {result['gradient_accumulation_steps']}"
        head = (f"| {result['name']} | {result.get('backend', result['attention'])} | "
                f"{'on' if result['gradient_checkpointing'] else 'off'} | {_levers(result)} | {tokens}")
        if "error" in result:
            lines.append(f"{head} | failed: {result['error']} | | | | | | |")
            continue
        trl = result["trl"]
        lines.append(
            f"{head} | {_med(result, 'fwd_bwd_gpu_s')} | "
            f"{_med(trl, 'perf/fwd_bwd_s')} | {_med(trl, 'perf/step_s')} / {_p90(trl, 'perf/step_s')} | "
            f"{_fmt_int(_med(trl, 'perf/trained_tok_s_wall_clock'))} | {_med(result, 'mfu_gpu')} / "
            f"{_med(trl, 'perf/mfu_fwd_bwd')} | {result['peak_gib'] and round(result['peak_gib'], 1)} | "
            f"{_med(trl, 'perf/weight_sync_s')} ({_med(trl, 'perf/weight_sync_transfer_s')}) |")
    goals = report.get("goals", GOALS)
    if "step_s" in goals:
        lines.append(f"| goal (issue 35) | | off | | 16,384 x 6 | <= {goals['fwd_bwd_s']} | | <= {goals['step_s']} | | "
                     f">= {goals['mfu_fwd_bwd']} | < {goals['peak_gib_without_checkpointing']:.0f} | |")
    lines.append(f"| reference (run 5) | FA3 | off | | 16,384 x 6 | | {REFERENCE['fwd_bwd_s']} | "
                 f"{REFERENCE['step_s']} | | / {REFERENCE['mfu_fwd_bwd']} | | |")
    profiled = [result for result in report["configs"] if result.get("profile")]
    if profiled:
        lines += ["", "| configuration (one profiled step) | GPU idle | " + " | ".join(PROFILE_COLUMNS) + " |",
                  "|---|---|" + "---|" * len(PROFILE_COLUMNS)]
        for result in profiled:
            shares = result["profile"]["share_of_gpu_time"]
            lines.append(f"| {result['name']} | {_pct(result['profile']['gpu_idle_share'])} | "
                         + " | ".join(_pct(shares.get(column, 0.0)) for column in PROFILE_COLUMNS) + " |")
    check = report.get("equivalence")
    if check:
        lines += ["", *equivalence_table(check)]
    return "\n".join(lines)


def equivalence_table(check: dict[str, Any]) -> list[str]:
    if "error" in check:
        return [f"Equivalence check: failed ({check['error']})."]
    exact = check.get("vs_float32", {})
    lines = [
        f"Equivalence check on {check['device']} ({check['dtype']}): one micro-batch of {check['tokens']:,} tokens, "
        f"{check['loss_terms']:,} loss terms, TRL's loss then the fast step's with its levers added one by one"
        + (f"; the exact loss (the same model in float32) is {check['loss_float32']:.6g}" if exact else "")
        + f". **{'Passed' if check['passed'] else 'Not passed'}** ({check['tolerance']['rule']}).",
        "",
        "| run | loss | vs TRL's step: loss, relative difference | LoRA gradient cosine | worst LoRA tensor, max "
        "relative difference | metrics, max absolute difference |" + (" vs float32: loss error | LoRA gradient "
                                                                      "cosine |" if exact else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if exact else ""),
    ]
    rows = [("TRL's step", None), ("TRL's step again", check["plain_vs_plain"]), *check.get("stages", {}).items()]
    for name, diff in rows:
        loss = check["loss_plain"] if diff is None else diff.get("loss", float("nan"))
        against = "| | | | |" if diff is None else (
            f"| {diff['loss_rel']:.1e} | {diff['grad_cosine']:.6f} | {diff['grad_max_rel']:.1e} | "
            f"{diff['metric_max_abs']:.1e} |")
        lines.append(f"| {name} | {loss:.6g} " + against + (
            f" {exact[name]['loss_abs']:.1e} | {exact[name]['grad_cosine']:.6f} |" if name in exact else ""))
    return lines


PROFILE_COLUMNS = ("base_and_head_matmul", "attention", "lora_matmul", "optimizer", "data_movement", "other")


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _fmt_int(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/bench-trainer.json")
    parser.add_argument("--work", default="results/bench-trainer-work", help="model, data and run folders")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: tiny model, the pure-PyTorch kernel")
    parser.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--config-timeout", type=float, default=420.0, help="seconds one configuration may take")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="seconds for all configurations together")
    parser.add_argument("--table", metavar="JSON", help="print the README table of a result file and exit")
    parser.add_argument("--equivalence", choices=("auto", "on", "off"), default="auto",
                        help="compare the fast step's loss and gradients with TRL's first (auto: on a GPU)")
    parser.add_argument("--set", metavar="JSON", help='override fields of every configuration, e.g. '
                        '\'{"warmup_steps": 1, "timed_steps": 1, "profiled": false}\' (a smoke run)')
    parser.add_argument("--one-equivalence", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--standin", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ["LORAFLEET_ENV_FILE"] = ""  # a developer's .env must not steer the benchmark
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    if args.one_equivalence:
        work = Path(args.work)
        check = equivalence(json.loads((work / "workload.json").read_text()), args.tiny)
        Path(args.result).write_text(json.dumps(check, indent=2))
        return 0
    if args.one:
        config = BenchConfig(**json.loads(args.one))
        work = Path(args.work)
        workload = json.loads((work / "workload.json").read_text())
        result = run_one(config, workload, args.standin, work, args.tiny)
        Path(args.result).write_text(json.dumps(result, indent=2))
        return 0
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            print("trainer_bench: the published shape needs a CUDA GPU (this python's torch sees none); "
                  "--tiny runs the same path on CPU", file=sys.stderr)
            return 2
    report = run_all(args)
    print(table(report))
    check_ok = "error" not in report.get("equivalence", {}) and report.get("equivalence", {}).get("passed", True)
    return 0 if check_ok and all("error" not in result for result in report["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
