"""The trainer's section: the task, the fleet it trains against, the GRPO and optimizer knobs, checkpoints, ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lorafleet.settings.common import CommonSettings, check_gpu_ids, check_urls, csv_items


class TrainerSettings(CommonSettings):
    """Trainer: TRL's AsyncGRPOTrainer with the LoRA adapter it publishes."""

    trainer_task: str = Field(
        "math", min_length=1, description="What to train: a built-in task (math: the published MATH run; jsonl: "
        "DATASET_PATH; tiny: the offline tiny model's task), a task file (path to a .py) or an importable module "
        "(docs/guides/tasks.md).",
    )
    task_timeout_s: float = Field(
        60.0, gt=0, description="Seconds one call of the task's code (a reward function over a group, one tool "
        "call) may take: a slower call is abandoned, scored as None (TRL leaves it out) or answered with an error.",
    )
    eval_every_steps: int = Field(
        10, ge=0, description="Score the task's eval set with the current adapter every this many steps (greedy, "
        "through the fleet, never pausing training); 0 = never.",
    )
    trainer_pin_episodes: bool = Field(
        True, description="Multi-turn rollouts: every turn of an episode uses the adapter version its first turn "
        "used (while the fleet still serves it); false = TRL's default, each turn takes the newest version.",
    )
    dataset_path: str = Field(
        "", description="Local JSONL/Parquet file (problem, solution): jsonl's data, or math's set offline."
    )
    trainer_vllm_url: str = Field(
        "http://proxy:8000", description="The proxy's fleet port as the trainer reaches it; "
        "http://proxy:8000/runs/<run> trains as run <run> on a shared fleet.",
    )
    trainer_fleet_wait_s: float = Field(
        600.0, gt=0, description="How long the trainer waits for an unreachable fleet (the proxy restarting or gone, "
        "no ready replica) before it gives up: rollouts and control calls retry, logged, at most 5 s apart.",
    )
    trainer_run_key_file: str = Field(
        "", description="File holding this trainer's run key (`lorafleet run-key`), sent as Bearer on every call to "
        "the fleet. Empty = none (the default run, or a fleet without run keys).",
    )
    run_weight: float = Field(1.0, gt=0, description="Fair-share weight of this trainer's run on a shared fleet.")
    learning_rate: float = Field(4e-5, gt=0, description="Optimizer learning rate.")
    num_generations: int = Field(8, ge=2, description="Rollouts per prompt (GRPO group size).")
    token_budget: int = Field(16384, ge=0, description="Tokens per packed micro-batch; 0 = fixed count batching.")
    gradient_accumulation_steps: int = Field(6, ge=1, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (saves memory).")
    max_inflight_per_replica: int = Field(128, ge=1, description="In-flight rollouts per replica (times replicas).")
    queue_maxsize: int = Field(0, ge=0, description="Scored-rollout queue size; 0 = 2 x in-flight rollouts.")
    max_completion_length: int = Field(3000, ge=1, description="Generated tokens per rollout at most.")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    max_steps: int = Field(500, ge=1, description="Optimizer steps to train.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every this many steps (resume after preemption).")
    checkpoint_keep: int = Field(
        2, ge=0, description="Newest checkpoints kept in the run folder (older ones deleted); 0 = keep all."
    )
    run_max_steps: int = Field(
        0, ge=0, description="Steps one trainer start may take, then checkpoint + final adapter + exit 0; 0 = no limit."
    )
    run_max_wall_s: float = Field(
        0.0, ge=0, description="Seconds one trainer start may run, then checkpoint + final adapter + exit 0; 0 = none."
    )
    trainer_min_free_gb: float = Field(
        1.0, ge=0, description="Free GB the trainer needs on ADAPTER_ROOT: refuses to start / stops with a checkpoint."
    )
    seed: int = Field(0, description="Training seed.")
    trainer_replicas: int = Field(
        0, ge=0, description="Replicas behind TRAINER_VLLM_URL; 0 = count the ready ones in the proxy's GET /fleet."
    )
    train_batch_size: int = Field(8, ge=1, description="Samples per micro-batch when TOKEN_BUDGET=0.")
    trainer_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 mixed precision on GPU, fp32 on CPU (match the replicas' VLLM_DTYPE)."
    )
    trainer_resume: bool = Field(True, description="Resume from the newest checkpoint in the run folder if any.")
    trainer_report_to: str = Field("none", description="Comma-separated report_to backends (none, wandb, trackio).")
    trainer_attention: Literal["auto", "fa3", "builtin", "torch"] = Field(
        "auto", description="Training attention kernel: auto = the Hub's FA3 on GPU if it can be fetched, else "
        "torch's built-in varlen FlashAttention (builtin); pure PyTorch (torch) on CPU.",
    )
    trainer_fast_step: bool = Field(
        True, description="One GPU: the trainer's fast step (next micro-batches packed in a process, a loss without "
        "host syncs, fused LoRA products, Liger's RMSNorm/SwiGLU/RoPE if installed); false = TRL's own step.",
    )
    trainer_cpu_threads: int = Field(
        1, ge=0, description="CPU mode: torch threads of the trainer (0 = torch's default); replicas use the rest."
    )
    trainer_server_timeout_s: float = Field(
        240.0, gt=0, description="Seconds the trainer waits for TRAINER_VLLM_URL to answer /health."
    )
    trainer_metrics_host: str = Field("127.0.0.1", description="Address the trainer's Prometheus /metrics binds to.")
    trainer_metrics_port: int = Field(
        9400, ge=0, le=65535, description="Port of the trainer's Prometheus /metrics (TRL's logged values); 0 = off."
    )
    trainer_gpus: str = Field(
        "0", description="GPUs the trainer uses (host indices as in nvidia-smi, comma-separated): one rank per GPU; "
        "must not overlap VLLM_GPUS.",
    )
    trainer_ranks: int = Field(
        0, ge=0, description="Training processes (ranks); 0 = one per GPU in TRAINER_GPUS, or 1 on CPU. On CPU set "
        "it for several ranks (gloo); on GPUs it must equal the TRAINER_GPUS count.",
    )
    trainer_sharding: Literal["auto", "fsdp2", "ddp"] = Field(
        "auto", description="How several ranks hold the model: fsdp2 shards it (auto on GPUs), ddp replicates it "
        "(auto on CPU, where accelerate cannot run FSDP).",
    )

    @field_validator("trainer_gpus")
    @classmethod
    def _gpu_list_is_ids(cls, value: str) -> str:
        return check_gpu_ids(value)

    @field_validator("trainer_vllm_url")
    @classmethod
    def _fleet_is_a_url(cls, value: str) -> str:
        return check_urls(value)

    @property
    def trainer_gpu_list(self) -> list[str]:
        return csv_items(self.trainer_gpus)
