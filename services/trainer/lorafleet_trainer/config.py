"""Map the shared settings onto TRL's AsyncGRPOConfig and PEFT's LoraConfig, in one pure function.

Defaults are those of the best published run: rank 1, alpha 2, all-linear,
lr 4e-5, 8 generations, token_budget 16384, no gradient checkpointing, 128 rollouts in flight per
replica, a queue of twice that, max_staleness 4, a sync every 4 steps, adam beta2 0.95.

With several ranks TRL packs each micro-batch into one row per rank: TOKEN_BUDGET (or TRAIN_BATCH_SIZE)
is per rank, so a step trains world_size times as much as one rank does (`summary` prints both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet.lora import build_lora_config
from lorafleet.settings import ConfigError, TrainerSettings

from lorafleet_trainer.proxy_client import ProxyClient
from lorafleet_trainer.ranks import RankPlan

# The published recipe's optimizer setting (the train script of the reference deployment).
ADAM_BETA2 = 0.95
TRL_SCORE_QUEUE_GROUPS = 16  # AsyncRolloutWorker's score_queue_maxsize default (TRL 1.16)


@dataclass(frozen=True)
class TrainerConfigs:
    """Everything the trainer is built from, and the one-line summary printed at start."""

    grpo: Any  # trl.experimental.async_grpo.AsyncGRPOConfig (imported lazily: TRL takes seconds to import)
    lora: Any  # peft.LoraConfig
    replicas: int
    ranks: RankPlan

    def summary(self) -> dict[str, Any]:
        """The effective values that matter at 3 a.m., as one flat JSON-able dict."""
        grpo, lora = self.grpo, self.lora
        return {
            "output_dir": grpo.output_dir,
            "vllm_server_base_url": grpo.vllm_server_base_url,
            "replicas": self.replicas,
            "lora_r": lora.r,
            "lora_alpha": lora.lora_alpha,
            "lora_target_modules": sorted(lora.target_modules) if isinstance(lora.target_modules, set)
            else lora.target_modules,
            **{
                field: getattr(grpo, field)
                for field in (
                    "learning_rate", "adam_beta2", "num_generations", "max_completion_length", "temperature",
                    "token_budget", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "gradient_checkpointing", "bf16", "dtype", "max_inflight_tasks", "queue_maxsize",
                    "max_staleness", "weight_sync_steps", "max_steps", "save_steps", "seed", "vllm_server_timeout",
                )
            },
            "report_to": grpo.report_to,
            **self.ranks.summary(),
            **micro_batching(grpo.token_budget, grpo.per_device_train_batch_size, self.ranks.world_size),
        }


def micro_batching(token_budget: int, batch_size: int, world_size: int) -> dict[str, int | None]:
    """What one micro-batch holds across all ranks: TRL gives each rank a row of the per-rank budget."""
    if token_budget > 0:
        return {"tokens_per_microbatch_per_rank": token_budget, "tokens_per_microbatch": token_budget * world_size,
                "samples_per_microbatch": None}
    return {"tokens_per_microbatch_per_rank": None, "tokens_per_microbatch": None,
            "samples_per_microbatch": batch_size * world_size}


def sharding_args(plan: RankPlan) -> dict[str, Any]:
    """TrainingArguments for the plan's sharding (transformers hands them to accelerate's plugins).

    FSDP2 with a sharded state dict: a full one gathers optimizer and model state onto rank 0 and, with PEFT,
    keeps only rank 0's shard (accelerate#4206); a sharded checkpoint loads on any rank count (torch's DCP
    reshards). Transformer blocks are the wrap units (the model's `_no_split_modules`).
    """
    if plan.sharding == "fsdp2":
        return {"fsdp": True, "fsdp_config": {
            "version": 2, "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_ram_efficient_loading": False,
        }}
    if plan.sharding == "ddp":
        # Only the adapter's parameters take gradients, and every one of them is used in each forward.
        # (The backend follows the device: accelerate picks NCCL on GPUs, gloo on CPU.)
        return {"ddp_find_unused_parameters": False}
    return {}


def use_bf16(settings: TrainerSettings, cuda: bool) -> bool:
    """bf16 mixed precision: TRL's default on GPU; never on CPU, where the replicas serve float32."""
    if settings.trainer_precision == "auto":
        return cuda
    return settings.trainer_precision == "bf16"


def base_dtype(bf16: bool) -> str:
    """The frozen base weights' dtype: bfloat16 under bf16 mixed precision, else float32 (TRL's default).

    LoRA trains only the adapter, which PEFT keeps in float32 whatever the base's dtype. Under autocast the base's
    matmuls run in bf16 either way, so a float32 base only doubles the weights' memory (3 GB more for 1.5B
    parameters) and re-casts them on every forward; in bf16 the trainer also computes as the bf16 replicas serve.
    """
    return "bfloat16" if bf16 else "float32"


def inflight_tasks(settings: TrainerSettings, replicas: int) -> int:
    """TRL's max_inflight_tasks caps the whole worker, not one server: scale it by the replica count."""
    return settings.max_inflight_per_replica * max(replicas, 1)


def build_configs(settings: TrainerSettings, *, replicas: int, ranks: RankPlan,
                  trl_args: dict[str, Any] | None = None) -> TrainerConfigs:
    """AsyncGRPOConfig + LoraConfig for `settings`, with output_dir = <ADAPTER_ROOT>/runs/<RUN_NAME>, plus the
    task's `trl_args` (AsyncGRPOConfig fields lorafleet has no setting for)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    fields = grpo_fields(settings, replicas=replicas, ranks=ranks)
    refuse_clashes(trl_args or {}, lorafleet_fields(settings))
    grpo = AsyncGRPOConfig(**fields, **(trl_args or {}))
    return TrainerConfigs(grpo=grpo, lora=build_lora_config(settings), replicas=replicas, ranks=ranks)


def refuse_clashes(trl_args: dict[str, Any], lorafleet_fields: set[str]) -> None:
    """ConfigError naming the task's trl_args that lorafleet sets from its own settings."""
    clash = sorted(set(trl_args) & lorafleet_fields)
    if clash:
        raise ConfigError(f"the task's trl_args set {', '.join(clash)}, which lorafleet sets from its settings: set "
                          "those in the task's `defaults` (lorafleet setting names) instead")


def lorafleet_fields(settings: TrainerSettings) -> set[str]:
    """Every AsyncGRPOConfig field lorafleet sets from its settings, on any device and sharding."""
    fields = set(grpo_fields(settings, replicas=1, ranks=RankPlan(1, "cpu", "none")))
    for sharding in ("fsdp2", "ddp"):
        fields |= set(sharding_args(RankPlan(2, "cuda", sharding)))
    return fields


def grpo_fields(settings: TrainerSettings, *, replicas: int, ranks: RankPlan) -> dict[str, Any]:
    """The AsyncGRPOConfig arguments lorafleet derives from `settings` (pure: nothing is built)."""
    cuda = ranks.device == "cuda"

    inflight = inflight_tasks(settings, replicas)
    report_to = [item.strip() for item in settings.trainer_report_to.split(",") if item.strip()] or ["none"]
    bf16 = use_bf16(settings, cuda)
    return dict(
        output_dir=str(settings.run_dir),
        vllm_server_base_url=ProxyClient.from_settings(settings, run_key="").url,  # the URL every call uses
        vllm_server_timeout=settings.trainer_server_timeout_s,
        learning_rate=settings.learning_rate,
        adam_beta2=ADAM_BETA2,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        token_budget=settings.token_budget,  # 0 = FixedCountBatcher of train_batch_size samples
        per_device_train_batch_size=settings.train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        gradient_checkpointing=settings.gradient_checkpointing,
        bf16=bf16,
        dtype=base_dtype(bf16),
        use_cpu=not cuda,  # on CPU accelerate joins the ranks' process group (gloo) only with use_cpu
        max_inflight_tasks=inflight,
        queue_maxsize=settings.queue_maxsize or 2 * inflight,
        max_staleness=settings.max_staleness,
        weight_sync_steps=settings.weight_sync_steps,
        max_steps=settings.max_steps,
        save_strategy="steps",
        save_steps=settings.save_steps,
        logging_steps=1,
        seed=settings.seed,
        report_to=report_to,
        log_level="info" if settings.log_level == "DEBUG" else "warning",  # transformers' own chatter
        disable_tqdm=True,
        **sharding_args(ranks),
    )


def score_queue_groups(queue_maxsize: int, num_generations: int) -> int:
    """Groups the rollout worker may hold between generation and scoring (TRL's hidden, fixed 16).

    Those groups sit in front of the `queue_maxsize` samples and add to every sample's staleness;
    bounding them by the same budget keeps small CPU runs on-policy and leaves big runs as TRL has them.
    """
    return max(1, min(TRL_SCORE_QUEUE_GROUPS, queue_maxsize // num_generations))
