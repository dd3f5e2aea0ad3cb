"""The one settings schema every lorafleet service reads.

Trainer, replicas and proxy all load this class from the same environment (and `.env`), so
MAX_STALENESS, LORA_RANK and ADAPTER_ROOT can never disagree between them. Values derived
from several settings (`max_loras`, `max_lora_rank`) are computed here and nowhere else.

Every field maps to the environment variable of the same name in upper case. The field's
`description` is the documentation: the README table and `.env.example` are checked against it.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path
from typing import Literal

from dotenv import dotenv_values
from pydantic import Field, ValidationError, computed_field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorafleet.adapters import metrics_path, run_dir
from lorafleet.runs import run_slots, slot_budget

# vLLM accepts only these values for --max-lora-rank (vllm/config/lora.py, TRL's VLLM_LORA_RANKS).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

ENV_FILE_VARIABLE = "LORAFLEET_ENV_FILE"
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Never echoed in error messages or logs.
# VLLM_CPU_SETS=auto: core sets from the cores a replica may use (works on any machine, replicas share cores).
AUTO_CPU_SETS = "auto"
SECRET_FIELDS = frozenset({"proxy_api_key", "proxy_upstream_token"})
# Variables that no longer exist, and what replaces them: refused at start rather than silently ignored.
RENAMED = {
    "PROXY_HOST": "PROXY_FLEET_HOST and PROXY_PUBLIC_HOST (one bind address per port)",
    "TRAINER_RECIPE": "TRAINER_TASK (the same names: math, jsonl, tiny; or a task file)",
}


class ConfigError(ValueError):
    """A setting is invalid; the message names the environment variable."""


def round_lora_rank(rank: int) -> int:
    """Smallest rank vLLM accepts for --max-lora-rank that still serves an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")


def _csv(value: str, sep: str = ",") -> list[str]:
    """The non-empty items of a `sep`-separated list, stripped."""
    return [item.strip() for item in value.split(sep) if item.strip()]


class Settings(BaseSettings):
    """Every knob of the stack. Grouped by the service that mostly uses it; all services read all."""

    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True)

    # --- shared: model, adapters, policy versions -------------------------------------------
    base_model: str = Field(
        "Qwen/Qwen2.5-Math-1.5B",
        description="Base model served by every replica and trained by the trainer (Hub id or local directory).",
    )
    adapter_root: Path = Field(
        Path("/adapters"),
        description="Shared adapter volume, mounted at this same absolute path in every service.",
    )
    run_name: str = Field("run1", description="Run folder under ADAPTER_ROOT/runs/ for adapters and checkpoints.")
    lora_rank: int = Field(1, ge=1, description="LoRA rank r of the trained adapter (<= 512).")
    lora_alpha: int = Field(2, ge=1, description="LoRA alpha (scaling = alpha / r).")
    max_staleness: int = Field(
        4, ge=0, description="Policy versions a rollout may lag behind; replicas get max_staleness + 2 LoRA slots."
    )
    fleet_max_runs: int = Field(
        1, ge=1, description="Training runs the fleet serves at once: replicas get "
        "FLEET_MAX_RUNS x (MAX_STALENESS + 2) LoRA slots, the proxy's slot budget.",
    )
    weight_sync_steps: int = Field(4, ge=1, description="Optimizer steps between adapter publications.")
    max_model_len: int = Field(4096, ge=16, description="Context length served by the replicas (prompt + completion).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level of every service.")

    # --- replicas ---------------------------------------------------------------------------
    replica_device: Literal["gpu", "cpu"] = Field(
        "gpu", description="gpu: each replica claims one GPU from VLLM_GPUS; cpu: one core set from VLLM_CPU_SETS."
    )
    replica_device_assignment: Literal["claim", "scheduler"] = Field(
        "claim", description="claim: each replica locks one device of the pool under ADAPTER_ROOT/.fleet (Compose: "
        "every replica sees every device); scheduler: the container was given its own (Kubernetes), no lock.",
    )
    vllm_gpus: str = Field("0", description="GPU pool the replicas claim from, one GPU each (e.g. 2,3,4,5).")
    vllm_cpu_sets: str = Field(
        "auto",
        description="CPU mode: core sets the replicas claim from, separated by ';' (e.g. 0;1 or 0-3;4-7); auto: one "
        "core each from the cores the replica may use, shared once every core has one.",
    )
    vllm_cpu_kv_cache_bytes: int = Field(
        134_217_728, ge=1_048_576, description="CPU mode: KV cache bytes per replica (128 MiB fits the tiny model)."
    )
    vllm_cpu_executor: Literal["uni", "mp"] = Field(
        "uni",
        description="CPU mode: uni runs the model in vLLM's engine process; mp (vLLM's own CPU default) in a worker "
        "process that busy-polls for a second after every step, a whole core per replica under light traffic.",
    )
    # Not VLLM_HOST/VLLM_PORT: vLLM reads VLLM_PORT itself (its internal communication port).
    replica_host: str = Field("0.0.0.0", description="Address each replica's vLLM server binds to.")
    replica_port: int = Field(8000, ge=1, le=65535, description="Port each replica's vLLM server listens on.")
    vllm_dtype: str = Field("auto", description="--dtype for vLLM (float32 for exact trainer/server logprob ratios).")
    vllm_gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="GPU mode: fraction of the GPU's memory vLLM may use."
    )
    vllm_extra_args: str = Field("", description="Extra arguments appended verbatim to every `vllm serve` command.")

    # --- proxy ------------------------------------------------------------------------------
    proxy_upstreams: str = Field("", description="Comma-separated replica base URLs (static discovery).")
    proxy_upstream_dns: str = Field(
        "", description="host:port re-resolved every PROXY_DNS_INTERVAL_S; every address is a replica (Compose)."
    )
    proxy_upstream_token: str = Field(
        "", description="Replicas' Bearer key (their vLLM API key); proxy and doctor send it. Empty = none. SECRET."
    )
    proxy_fleet_host: str = Field(
        "127.0.0.1", description="Address the fleet port binds to: only an address the trainer's network reaches."
    )
    proxy_public_host: str = Field("127.0.0.1", description="Address the public port binds to.")
    proxy_port: int = Field(
        8000, ge=1, le=65535, description="Fleet port: internal network; no credentials but a named run's key "
        "(RUN_KEYS_DIR).",
    )
    proxy_public_port: int = Field(
        8080, ge=1, le=65535, description="Public port; needs PROXY_API_KEY, every request a Bearer key."
    )
    proxy_api_key: str = Field("", description="Bearer key of the public port. Empty = no public port. SECRET.")
    run_keys_dir: str = Field(
        "", description="Run keys: a directory of key hashes, one file per run (`lorafleet run-key NAME` writes "
        "them); set = a named run's routes on the fleet port need that run's Bearer key. Empty = off.",
    )
    proxy_routing: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="Rollout routing: KV-prefix affinity, or the least_loaded / round_robin baselines."
    )
    proxy_imbalance: int = Field(
        8, ge=0, description="Affinity yields to the least-loaded replica when it is this many requests ahead."
    )
    proxy_block_size: int = Field(
        0, ge=0, description="Routing block size in tokens; 0 = the replicas' KV block size (fallback 16)."
    )
    proxy_max_tracked_blocks: int = Field(
        200_000, ge=1000, description="Routing table cap (blocks); least recently used are forgotten first."
    )
    proxy_lora_load_timeout_s: float = Field(
        300.0, gt=0, description="Deadline for a fleet-wide adapter load (retries 'No adapter found')."
    )
    proxy_min_ready: int = Field(1, ge=1, description="Ready replicas needed for the proxy's /health to be 200.")
    proxy_health_interval_s: float = Field(2.0, gt=0, description="Seconds between health checks of each replica.")
    proxy_eject_after: int = Field(
        2, ge=1, description="Consecutive failed health checks (bad status, malformed answer) that eject a replica."
    )
    proxy_health_timeout_s: float = Field(5.0, gt=0, description="Timeout of one replica health check.")
    proxy_eject_slow_after_s: float = Field(
        30.0, gt=0, description="Health checks timing out for this long eject a replica (refused/reset: at once)."
    )
    proxy_sync_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait before retrying a replica whose catch-up sync keeps failing."
    )
    proxy_dns_interval_s: float = Field(5.0, gt=0, description="Seconds between DNS re-resolutions of replicas.")
    proxy_request_timeout_s: float = Field(
        900.0, gt=0, description="Read timeout of one routed request to a replica."
    )
    proxy_route_max_blocks: int = Field(
        64, ge=1, description="Routing hashes at most this many leading blocks of each prompt (bounds its cost)."
    )
    proxy_max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest request body the proxy accepts on any route (413 above)."
    )
    proxy_sync_pause: Literal["elide", "broadcast"] = Field(
        "elide",
        description="elide: a keep pause on the fleet port (trainer sync) pauses no replica; broadcast: it does.",
    )
    run_lease_s: float = Field(
        900.0, gt=0, description="A named run that sends nothing this long is expired: its adapters are unloaded "
        "fleet-wide and its LoRA slots returned.",
    )
    proxy_fair_inflight_per_replica: int = Field(
        64, ge=1, description="While several runs generate: requests in flight per ready replica, beyond which the "
        "proxy queues them by fair share (tokens per run weight); at most the engine's batch (--max-num-seqs).",
    )
    proxy_fair_pipeline_per_replica: int = Field(
        1, ge=0, description="While several runs generate: requests each replica gets beyond "
        "PROXY_FAIR_INFLIGHT_PER_REPLICA, waiting in its engine, so a batch slot that frees is refilled at once "
        "rather than an answer's round trip later (0 = none).",
    )
    proxy_canary_interval_s: float = Field(
        30.0, ge=0, description="Seconds between agreement-canary rounds (every ready replica probed for the base "
        "model and each run's newest adapter, answers compared); 0 = only at loads and re-syncs.",
    )
    proxy_canary_tokens: int = Field(
        4, ge=1, le=64, description="Greedy tokens of one canary probe (its cost; more tokens see smaller faults).",
    )
    proxy_canary_logprob_tolerance: float = Field(
        0.02, ge=0, description="Largest log-probability difference between two replicas' canary answers that still "
        "counts as the same weights (batch composition moves the last digits; README 'Agreement canary').",
    )
    proxy_canary_timeout_s: float = Field(
        60.0, gt=0, description="Timeout of one canary probe (a replica that does not answer in time has no vote).",
    )
    proxy_breaker_failures: int = Field(
        3, ge=1, description="Routed generations failing in a row (5xx, reset, timeout) that take a replica out of "
        "routing until it generates again (the circuit breaker).",
    )
    proxy_breaker_window: int = Field(
        20, ge=2, description="Routed generations per replica over which the breaker's failure rate is counted.",
    )
    proxy_breaker_failure_rate: float = Field(
        0.5, gt=0, le=1, description="Failed share of the last PROXY_BREAKER_WINDOW generations (once half of it "
        "is seen) that trips the breaker.",
    )

    # --- trainer ----------------------------------------------------------------------------
    trainer_task: str = Field(
        "math", min_length=1, description="What to train: a built-in task (math: the published MATH run; jsonl: "
        "DATASET_PATH; tiny: the offline tiny model's task), a task file (path to a .py) or an importable module "
        "(README 'Your own task').",
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

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_folder_name(cls, value: str) -> str:
        if not RUN_NAME_PATTERN.match(value):
            raise ValueError(f"must match {RUN_NAME_PATTERN.pattern} (a plain folder name)")
        return value

    @field_validator("adapter_root")
    @classmethod
    def _adapter_root_is_absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path (replicas must see adapters at the same path)")
        return value

    @field_validator("lora_rank")
    @classmethod
    def _rank_is_servable(cls, value: int) -> int:
        round_lora_rank(value)
        return value

    @field_validator("vllm_gpus", "trainer_gpus")
    @classmethod
    def _gpu_pool_is_ids(cls, value: str) -> str:
        ids = _csv(value)
        if not ids or not all(item.isdigit() for item in ids) or len(set(ids)) != len(ids):
            raise ValueError("must be distinct GPU indices separated by commas, e.g. 0,1,2")
        return value

    @field_validator("vllm_cpu_sets")
    @classmethod
    def _cpu_sets_are_core_lists(cls, value: str) -> str:
        if value.strip() == AUTO_CPU_SETS:
            return value
        sets = _csv(value, ";")
        if not sets or not all(re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", item) for item in sets):
            raise ValueError("must be core sets separated by ';', each like 0 or 0-3 or 0,2")
        return value

    @field_validator("proxy_upstreams", "trainer_vllm_url")
    @classmethod
    def _upstreams_are_urls(cls, value: str) -> str:
        for url in _csv(value):
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return value

    @field_validator("proxy_upstream_dns")
    @classmethod
    def _dns_is_host_port(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", value):
            raise ValueError("must be host:port, e.g. vllm:8000")
        return value

    @model_validator(mode="after")
    def _ports_differ(self) -> Settings:
        if self.proxy_api_key and self.proxy_port == self.proxy_public_port:
            raise ValueError("PROXY_PORT and PROXY_PUBLIC_PORT must differ")
        return self

    # --- derived values: computed here, used everywhere ---------------------------------------
    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def max_loras(self) -> int:
        """LoRA slots per replica: max_staleness + 1 versions can be in flight, and a sync loads before it unloads;
        once per run the fleet serves at once."""
        return slot_budget(self.fleet_max_runs, self.max_staleness)

    @property
    def run_slots(self) -> int:
        """LoRA slots one run of this staleness reserves on every replica."""
        return run_slots(self.max_staleness)

    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def max_lora_rank(self) -> int:
        """--max-lora-rank for the replicas: the adapter rank rounded up to a value vLLM accepts."""
        return round_lora_rank(self.lora_rank)

    @property
    def upstream_urls(self) -> list[str]:
        """Static replica URLs, without trailing slashes."""
        return [url.rstrip("/") for url in _csv(self.proxy_upstreams)]

    @property
    def gpu_pool(self) -> list[str]:
        return _csv(self.vllm_gpus)

    @property
    def trainer_gpu_list(self) -> list[str]:
        return _csv(self.trainer_gpus)

    @property
    def cpu_pool(self) -> list[str]:
        """VLLM_CPU_SETS as core sets; `auto`: each core this process may run on (its cgroup's cpuset)."""
        if self.cpu_sets_auto:
            return [str(core) for core in sorted(os.sched_getaffinity(0))]
        return _csv(self.vllm_cpu_sets, ";")

    @property
    def cpu_sets_auto(self) -> bool:
        return self.vllm_cpu_sets.strip() == AUTO_CPU_SETS

    @property
    def run_dir(self) -> Path:
        return run_dir(self.adapter_root, self.run_name)

    @property
    def metrics_path(self) -> Path:
        return metrics_path(self.adapter_root, self.run_name)


def gpus_shared(settings: Settings) -> list[str]:
    """GPUs listed in both TRAINER_GPUS and VLLM_GPUS (on one box, a replica would claim a trainer GPU)."""
    return sorted(set(settings.trainer_gpu_list) & set(settings.gpu_pool), key=int)


def env_name(field: str) -> str:
    """The environment variable that sets `field`."""
    return field.upper()


def _refuse_renamed(env_file: str | None) -> None:
    in_file = dotenv_values(env_file) if env_file and Path(env_file).is_file() else {}
    stale = [name for name in RENAMED if name in os.environ or name in in_file]
    if stale:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(f"{name}: replaced by {RENAMED[name]}"
                                                                    for name in stale))


def load_settings(**overrides: object) -> Settings:
    """Read the settings, turning validation errors into one ConfigError that names each variable.

    The environment wins over `.env` in the working directory. LORAFLEET_ENV_FILE names another file,
    or none when empty (`make test` sets it empty, so a developer's stack `.env` cannot steer the tests).
    """
    env_file = os.environ.get(ENV_FILE_VARIABLE, ".env") or None
    _refuse_renamed(env_file)
    try:
        return Settings(_env_file=env_file, **overrides)  # type: ignore[arg-type, call-arg]
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "settings"
            message = error["msg"].removeprefix("Value error, ")
            # Model-level errors carry every input as `input`, secrets included: show values of plain fields only.
            shown = "" if not error["loc"] or error["loc"][0] in SECRET_FIELDS else f" (got {error.get('input')!r})"
            problems.append(f"{env_name(where)}: {message}{shown}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None
