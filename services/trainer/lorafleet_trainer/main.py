"""`lorafleet-train`: TRL's AsyncGRPOTrainer with a LoRA adapter, synced adapter-only to the fleet.

Settings (TrainerSettings: the common and trainer sections) come from the environment (and .env) like every lorafleet
service's; each trainer setting also has a flag (`--learning-rate 1e-4` = LEARNING_RATE=1e-4, flags win). The task's
defaults fill only what nobody set. `train()` is its phases, in order: check (start_checks.py: disk, a run whose
newest checkpoint reached MAX_STEPS ends here (already_complete), the task, the fleet's size; no heavy import) ->
start (the rollout fork server) -> build (configs, printed; preflight: refuse what cannot serve adapter-only sync;
sweep stale policy names; TRL patched (trl_seam.py) and the trainer built) -> wire (the built trainer's TRL objects)
-> run (resuming from the newest complete checkpoint: weights, optimizer, RNG, the prompt stream's position and the
adapter numbering, resume.py) -> finish (export <run>/final-adapter). A signal, RUN_MAX_STEPS,
RUN_MAX_WALL_S or low disk ends training early with a checkpoint and exit 0 (lifecycle.py).
With several ranks (TRAINER_GPUS, TRAINER_RANKS) this process launches them and each runs the above;
rank 0 alone talks to the fleet (ranks.py).

TRL spawns its rollout worker, which re-imports the main module: nothing may run at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafleet.logs import configure, log_event
from lorafleet.settings import ConfigError, TrainerSettings, env_name, load_settings
from lorafleet.vllm_api import VLLMError

from lorafleet_trainer import early_stop, trl_seam
from lorafleet_trainer.ranks import (
    Launcher,
    RankContext,
    RankPlan,
    die_with_parent,
    leave_process_group,
    pin_cpu_device,
    plan_for,
    select_gpus,
)
from lorafleet_trainer.run_key_file import read_run_key
from lorafleet_trainer.start_checks import (
    EXIT_PREFLIGHT,
    Checked,
    StartEnded,
    Unspent,
    check_start,
    refuse_spent_start,
    stopped_before_training,
)
from lorafleet_trainer.stops import CEILINGS, StopDecision, StoppedWhileWaiting
from lorafleet_trainer.tasks.loader import read_task_settings

if TYPE_CHECKING:
    from lorafleet_trainer.attention import Choice
    from lorafleet_trainer.config import TrainerConfigs
    from lorafleet_trainer.evaluation import EvalCallback
    from lorafleet_trainer.fast_step.options import StepOptions
    from lorafleet_trainer.lifecycle import RunLifecycle
    from lorafleet_trainer.ratio_by_replica import ReplicaRatios
    from lorafleet_trainer.resume import PromptTracker
    from lorafleet_trainer.tasks.spec import Task

log = logging.getLogger("lorafleet_trainer")

# Settings a flag can override: every trainer knob plus the shared ones the trainer reads.
FLAG_FIELDS = (
    "trainer_task", "base_model", "dataset_path", "adapter_root", "run_name", "trainer_vllm_url", "trainer_replicas",
    "lora_rank", "lora_alpha", "learning_rate", "num_generations", "max_completion_length", "temperature",
    "token_budget", "train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
    "max_inflight_per_replica", "queue_maxsize", "max_staleness", "weight_sync_steps", "max_steps", "save_steps",
    "seed", "trainer_precision", "trainer_resume", "trainer_report_to", "trainer_attention", "trainer_cpu_threads",
    "trainer_server_timeout_s", "log_level", "checkpoint_keep", "run_max_steps", "run_max_wall_s",
    "trainer_min_free_gb", "trainer_gpus", "trainer_ranks", "trainer_sharding", "trainer_fast_step",
    "task_timeout_s", "eval_every_steps", "trainer_pin_episodes",
)
EXIT_CONFIG = 2
EXIT_CRASH = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet-train", description=__doc__.split("\n\n")[0])
    for name in FLAG_FIELDS:
        description = TrainerSettings.model_fields[name].description or ""
        flag = "--" + name.removeprefix("trainer_").replace("_", "-")
        parser.add_argument(flag, dest=name, metavar=env_name(name), help=description)
    parser.add_argument(
        "--dry-run", action="store_true", help="print the effective configuration and exit without touching the fleet"
    )
    return parser


def resolve_settings(overrides: dict[str, Any]) -> TrainerSettings:
    """The trainer's settings from env + flags, then the task's defaults for whatever nobody set."""
    settings = load_settings(TrainerSettings, **overrides)
    task, _ = read_task_settings(settings.trainer_task)
    unset = {key: value for key, value in task.defaults.items() if key not in settings.model_fields_set}
    if unset:
        settings = load_settings(TrainerSettings, **overrides, **unset)
    return settings


def train(settings: TrainerSettings, plan: RankPlan, context: RankContext, dry_run: bool = False, *,
          run_key: str, unspent: Unspent) -> int:
    """Build and run the trainer as rank `context.rank` of `plan`; returns the process exit code.

    `run_key` (read_run_key: TRAINER_RUN_KEY_FILE's content, "" = none) goes on every call to the fleet; `unspent`
    is what main's refusals of a spent start found (start_checks.refuse_spent_start). The phases run in this order,
    each ending the start (StartEnded) where it must: the cheap checks before any heavy import.
    """
    try:
        checked = check_start(settings, unspent, main_rank=context.rank == 0, dry_run=dry_run, run_key=run_key)
        if not dry_run:
            start_rollout_server(checked)
        configs, attention = configure_run(settings, plan, checked)
        if dry_run:
            return 0
        swept = ready_fleet(settings, configs, checked, run_key)
        built = build(settings, configs, checked, swept, run_key, backend=attention.backend, cuda=plan.device == "cuda")
        wire(built, run_key, settings)
    except StartEnded as ended:
        return ended.code
    return run_until_stopped(built.trainer, built.lifecycle, checked.resume_from)


@dataclass(frozen=True)
class Built:
    """The built trainer, its lifecycle callback and the callbacks `wire` binds to it."""

    trainer: Any
    lifecycle: RunLifecycle
    evaluation: list[EvalCallback]
    ratios: ReplicaRatios
    prompts: PromptTracker


def start_rollout_server(checked: Checked) -> None:
    """Rank 0's fork server for TRL's rollout child, started once the checks passed and the environment is final
    (the task file, the devices): its imports run beside this process's own (rollout_server.py)."""
    if checked.main_rank:
        from lorafleet_trainer import rollout_server

        rollout_server.start()


def configure_run(settings: TrainerSettings, plan: RankPlan, checked: Checked) -> tuple[TrainerConfigs, Choice]:
    """The configs and the attention kernel, with every config error raised before the fleet is changed (a forced
    kernel that cannot run here, a TRL whose rollouts could not send the key, a checkpoint the ranks cannot load);
    the effective configuration logged."""
    from lorafleet_trainer.attention import UnsupportedAttention, choose_backend
    from lorafleet_trainer.checkpoints import check_resumable
    from lorafleet_trainer.config import build_configs
    from lorafleet_trainer.fleet_rollouts import check_rollout_hooks

    cuda = plan.device == "cuda"
    try:
        attention = choose_backend(settings.trainer_attention, cuda=cuda)
    except UnsupportedAttention as exc:
        raise ConfigError(str(exc)) from exc
    if checked.main_rank:
        log_event(log, "attention_backend", backend=attention.backend, reason=attention.reason)
    check_rollout_hooks()  # a TRL whose rollouts could not send the key or wait for the fleet: a config error, here
    task_settings = checked.task.settings if checked.task else read_task_settings(settings.trainer_task)[0]
    configs = build_configs(settings, replicas=checked.replicas, ranks=plan, trl_args=task_settings.trl_args)
    if checked.checkpoint:
        check_resumable(checked.checkpoint, fsdp2=plan.sharding == "fsdp2")
    if checked.main_rank:
        log_event(
            log, "effective_config", task=settings.trainer_task, base_model=settings.base_model,
            device=plan.device, attention=attention.backend, threads=None if cuda else settings.trainer_cpu_threads,
            resume_from=checked.resume_from, checkpoint_keep=settings.checkpoint_keep,
            run_max_steps=settings.run_max_steps, run_max_wall_s=settings.run_max_wall_s,
            min_free_gb=settings.trainer_min_free_gb, **configs.summary(),
        )
    return configs, attention


def ready_fleet(settings: TrainerSettings, configs: TrainerConfigs, checked: Checked, run_key: str) -> list[str]:
    """The fleet registered, preflighted and swept of stale policy names (rank 0); returns the swept names. A stop
    before or during it, or a refusal, ends the start."""
    from lorafleet_trainer.fleet_preflight import PreflightError, StopRequested, prepare_fleet

    if stopped_before_training(checked.stops, checked.resume_from):
        raise StartEnded(0)
    if not checked.main_rank:
        return []
    try:
        return asyncio.run(prepare_fleet(settings, configs.lora, run_key=run_key,
                                         stopping=checked.stops.stop_requested))
    except StopRequested:
        stopped_before_training(checked.stops, checked.resume_from)
        raise StartEnded(0) from None
    except (PreflightError, VLLMError) as exc:
        log_event(log, "refused", logging.ERROR, reason=str(exc))
        raise StartEnded(EXIT_PREFLIGHT) from None


def build(settings: TrainerSettings, configs: TrainerConfigs, checked: Checked, swept: list[str], run_key: str, *,
          backend: str, cuda: bool) -> Built:
    """TRL's modules patched (the seam's first part: the trainer's own __init__ asks the fleet), then the trainer
    with its callbacks, in the order their hooks must run."""
    from lorafleet_trainer.evaluation import eval_callbacks
    from lorafleet_trainer.exporter import exporter_callbacks
    from lorafleet_trainer.lifecycle import RunLifecycle
    from lorafleet_trainer.proxy_client import ProxyClient
    from lorafleet_trainer.published_files import readable_before_load
    from lorafleet_trainer.ratio_by_replica import ReplicaRatios
    from lorafleet_trainer.ratio_report import RatioReporter
    from lorafleet_trainer.resilience import retry_control_calls
    from lorafleet_trainer.resume import PromptTracker
    from lorafleet_trainer.run_state import MetricsJsonl

    install_kernels(settings, backend, cuda=cuda)
    proxy = ProxyClient.from_settings(settings, run_key)
    # A proxy restart mid-sync must not kill the run; TRL's calls send the key.
    retry_control_calls(proxy=proxy, fleet_wait_s=settings.trainer_fleet_wait_s)
    readable_before_load()  # the proxy, another user in Compose, copies what it loads
    if checked.checkpoint and checked.main_rank:
        log_event(log, "resuming", checkpoint=checked.checkpoint.path, step=checked.checkpoint.step,
                  model_version=checked.checkpoint.model_version)
    metrics = MetricsJsonl(settings.metrics_path)
    evaluation = eval_callbacks(checked.task, settings, run_key, checked.main_rank, metrics.append)  # joins the step
    prompts = PromptTracker(settings.run_dir, checked.checkpoint, fleet_names=swept)  # before TRL's own callbacks
    # Before metrics and the exporter: it adds to the logged dict; an outlier replica is reported to the proxy.
    ratios = ReplicaRatios(settings.run_dir, RatioReporter(proxy))
    lifecycle = RunLifecycle(checked.stops)
    callbacks = [*evaluation, ratios, metrics, lifecycle, prompts, *exporter_callbacks(settings)]
    trainer = build_trainer(settings, configs, callbacks, task=checked.task)
    return Built(trainer, lifecycle, evaluation, ratios, prompts)


def wire(built: Built, run_key: str, settings: TrainerSettings) -> None:
    """The built trainer's TRL objects patched (the seam's second part), before `train()` spawns the rollout child."""
    from lorafleet_trainer.fleet_rollouts import wire_rollouts
    from lorafleet_trainer.lifecycle import shield_rollout_worker
    from lorafleet_trainer.provenance import record_rollouts

    trainer = built.trainer
    for callback in built.evaluation:
        callback.bind(trainer)
    record_rollouts(trainer, settings.run_dir)  # TRL's queue, before prompts.bind wraps it
    built.ratios.bind(trainer)
    built.prompts.bind(trainer)
    shield_rollout_worker(trainer, built.lifecycle.stops)
    wire_rollouts(trainer, run_key, settings)


def install_kernels(settings: TrainerSettings, backend: str, *, cuda: bool) -> None:
    """CPU support (no CUDA peak-FLOPs query, bounded threads) where there is no GPU, then the attention kernel."""
    from lorafleet_trainer.attention import install
    from lorafleet_trainer.cpu import install_cpu_support

    if not cuda:
        install_cpu_support(settings.trainer_cpu_threads)
    install(backend)


def build_trainer(settings: TrainerSettings, configs: TrainerConfigs, callbacks: list[Any],
                  step: StepOptions | None = None, task: Task | None = None) -> Any:
    """TRL's AsyncGRPOTrainer as lorafleet-train runs it: the task's data, rewards and tools (`task`, else
    TRAINER_TASK's, prepared here), LoRA, a bounded score queue,
    and the fast step (fast_step/) where TRAINER_FAST_STEP resolves to it (`step` overrides, for the benchmark).

    Shared with the trainer benchmark (bench/trainer_bench.py), which times this very object.
    """
    from transformers import PrinterCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from lorafleet_trainer.config import score_queue_groups
    from lorafleet_trainer.fast_step.options import step_options

    if step is None:
        step = step_options(settings.trainer_fast_step, device=configs.ranks.device, sharding=configs.ranks.sharding)
    step = with_liger(settings, step)
    trainer_class = AsyncGRPOTrainer
    if step.custom_trainer:
        from lorafleet_trainer.fast_trainer import FastStepTrainer

        trainer_class = FastStepTrainer
    if task is None:
        from lorafleet_trainer.tasks.checks import prepare_task

        task, _ = prepare_task(settings)
    trainer = trainer_class(
        model=settings.base_model,
        args=configs.grpo,
        processing_class=task.tokenizer,
        peft_config=configs.lora,
        callbacks=callbacks,
        **task.trainer_kwargs(),
    )
    trainer.remove_callback(PrinterCallback)  # MetricsJsonl logs each step as one structured line instead
    bound_score_queue(trainer, score_queue_groups(configs.grpo.queue_maxsize, configs.grpo.num_generations))
    trl_seam.set_step_options(trainer, tune_step(trainer, configs, step))
    if trainer.accelerator.is_main_process:
        log_event(log, "trainer_step", **trainer.lorafleet_step.summary())
    return trainer


def with_liger(settings: TrainerSettings, step: StepOptions) -> StepOptions:
    """Liger's kernels applied where the step asks for them, before the model is built (Liger swaps the architecture's
    module classes); the step without them where the architecture has none."""
    if not step.liger:
        return step
    from transformers import AutoConfig

    from lorafleet_trainer.fast_step.kernels import apply_liger

    skipped = apply_liger(AutoConfig.from_pretrained(settings.base_model, trust_remote_code=False).model_type)
    if not skipped:
        return step
    log_event(log, "liger_kernels_skipped", logging.WARNING, reason=skipped)
    return replace(step, liger=False)


def tune_step(trainer: Any, configs: TrainerConfigs, step: StepOptions) -> StepOptions:
    """The built model tuned as the step asks (bf16 adapter inputs, fused LoRA layers, the indexed head); returns the
    step as it turned out."""
    from lorafleet_trainer.fast_step.loss import install_indexed_head
    from lorafleet_trainer.fused_lora import fuse_lora_layers
    from lorafleet_trainer.lora_precision import autocast_adapter_inputs

    if configs.grpo.bf16:  # autocast runs the adapter's products in bf16: no float32 copies of their inputs
        log_event(log, "lora_input_casts_off", layers=autocast_adapter_inputs(trainer.model))
    if step.fused_lora:
        step = replace(step, fused_lora=fuse_lora_layers(trainer.model) > 0)
    if step.custom_trainer:
        indexed = step.sync_free_loss and install_indexed_head(trainer.model.get_base_model(), trainer.temperature)
        step = trainer.configure_step(step, indexed_head=indexed)
    return step


def run_until_stopped(trainer: Any, lifecycle: RunLifecycle, resume_from: Path | None) -> int:
    """Train to MAX_STEPS or to an early stop, then finish: checkpoint, export, the last line."""
    from lorafleet_trainer.lifecycle import stop_agreement

    stops = lifecycle.stops
    stops.agree = stop_agreement(trainer.accelerator)
    if stopped_before_training(stops, resume_from):  # signalled while the fleet was checked or the model loaded
        return 0
    run(trainer, stops, resume_from)
    return finish(trainer, stops)


def run(trainer: Any, stops: StopDecision, resume_from: Path | None) -> None:
    """TRL's training loop, resumed from `resume_from`; a stop while it waited for rollouts leaves a checkpoint."""
    from lorafleet_trainer.lifecycle import checkpoint_now

    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except StoppedWhileWaiting:
        checkpoint_now(trainer, stops)


def finish(trainer: Any, stops: StopDecision) -> int:
    """The final adapter exported where the outcome calls for it (on every rank), the last line logged."""
    from lorafleet_trainer.run_state import export_final_adapter

    state, reason = trainer.state, stops.reason
    finished = reason is None or state.global_step >= state.max_steps
    # Every rank takes part (gathering a sharded adapter is a collective), so every rank must agree to: a ceiling
    # one rank reached (its clock, its disk) while another stops for OTHER_RANK exports on all of them.
    final = None
    if stops.agree(finished or reason in CEILINGS):
        final = export_final_adapter(trainer, Path(trainer.args.output_dir))
    if not trainer.accelerator.is_main_process:
        log_event(log, "rank_finished", rank=trainer.accelerator.process_index, step=state.global_step, reason=reason)
        return 0
    if finished:
        log_event(log, "finished", steps=state.global_step, model_version=trainer.model_version, adapter=final)
    else:
        log_event(
            log, "stopped", reason=reason, step=state.global_step, model_version=trainer.model_version,
            checkpoint=Path(trainer.args.output_dir) / f"checkpoint-{state.global_step}", adapter=final,
            resume="start again with the same RUN_NAME",
        )
    return 0


def bound_score_queue(trainer: Any, groups: int) -> None:
    """Set the rollout worker's score-queue size (TRL 1.16 has no config field; the child gets `_loop_kwargs`)."""
    worker = getattr(trainer, "rollout_worker", None)
    if trl_seam.loop_kwargs(worker) is not None:
        trl_seam.set_loop_kwargs(worker, **{trl_seam.SCORE_QUEUE_KWARG: groups})
        log_event(log, "score_queue_bounded", groups=groups)
    elif trainer.accelerator.is_main_process:
        log_event(log, "score_queue_unbounded", logging.WARNING, reason="rollout worker has no _loop_kwargs")


def cuda_devices() -> int:
    """GPUs torch sees (after select_gpus): 0 means CPU mode."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = build_parser().parse_args(argv)
    overrides = {name: value for name in FLAG_FIELDS if (value := getattr(args, name)) is not None}
    context = RankContext.from_environ(os.environ)
    if context.launcher_pid is not None:
        die_with_parent(context.launcher_pid)
    try:
        settings = resolve_settings(overrides)
    except ConfigError as exc:
        print(f"lorafleet-train: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure("trainer", settings.log_level, loggers=("trl",),
              fields={"rank": context.rank} if context.launched else None)
    if context.rank > 0:  # TRL logs the same lines on every rank: rank 0's are enough
        logging.getLogger("trl").setLevel(max(logging.WARNING, logging.getLogger("trl").level))
    try:
        run_key = read_run_key(settings)  # once, before anything (the launcher too) starts or asks the fleet
        select_gpus(settings, os.environ)
        unspent = refuse_spent_start(settings, main_rank=context.rank == 0, dry_run=args.dry_run)  # before torch
        plan = plan_for(settings, context, cuda_devices())
        pin_cpu_device(plan, os.environ)
        if plan.launched and not context.launched and not args.dry_run:
            return Launcher(plan, sys.argv[1:] if argv is None else argv).run()
        code = train(settings, plan, context, dry_run=args.dry_run, run_key=run_key, unspent=unspent)
        leave_process_group()  # a normal return only: a crash ends at once (entry), its group as it is
        return code
    except StartEnded as ended:
        return ended.code
    except ConfigError as exc:
        log_event(log, "config_error", logging.ERROR, reason=str(exc))
        return EXIT_CONFIG


def entry() -> int:
    """The `lorafleet-train` process (console script and each rank): stop signals are held from its first instant
    (early_stop.py: a container's PID 1 would drop them), then `main`.

    A crash ends the process at once with EXIT_CRASH, its traceback printed: the interpreter's own shutdown would
    join multiprocessing's queue feeder threads, and one whose reader (TRL's rollout child) died blocks forever, so a
    crashed trainer would hang instead of exiting and being restarted.
    """
    early_stop.hold()
    try:
        return main()
    except Exception:
        traceback.print_exc()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CRASH)


if __name__ == "__main__":
    sys.exit(entry())
