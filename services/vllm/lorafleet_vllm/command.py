"""Build the `vllm serve` command and environment of one replica from the shared settings.

Everything the fleet relies on is set here and only here: runtime LoRA updating and dev mode on
(the proxy loads adapters and pauses replicas), --max-loras = FLEET_MAX_RUNS x (max_staleness + 2), the
proxy's slot budget for the runs sharing the fleet, and the rounded
--max-lora-rank (TRL's trainer refuses a server with fewer slots; docs/reference/settings.md#lora_rank), processed
logprobs (the behaviour policy's logprobs TRL uses as PPO denominator), vLLM's own generation config and, in CPU mode,
chunked prefill off (vllm-cpu's engine dies on TRL's seeded requests when a prefill is split) and VLLM_DTYPE=auto as
float32 (served_dtype).
With PROXY_UPSTREAM_TOKEN set, vLLM gets it as its API key through VLLM_API_KEY (not `--api-key`,
which would show it in every process listing). vLLM 0.31 guards only /v1/*, /v2/*, /inference/*
and /cohere/* with it; its dev routes (/pause, /collective_rpc, ...) stay open (see SECURITY.md).
"""

from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from lorafleet.engine_identity import EXTENSION_CLASS
from lorafleet.settings import ReplicaSettings

# lorafleet's own settings that share vLLM's VLLM_ prefix. They are removed from the environment
# handed to vLLM, which would otherwise warn about unknown VLLM_* variables at every start.
OWN_VLLM_VARIABLES = frozenset(
    {"VLLM_GPUS", "VLLM_CPU_SETS", "VLLM_CPU_KV_CACHE_BYTES", "VLLM_CPU_EXECUTOR", "VLLM_DTYPE",
     "VLLM_GPU_MEMORY_UTILIZATION", "VLLM_EXTRA_ARGS"}
)

# vLLM reads its API key from here when --api-key is not given (vllm/entrypoints/serve/middleware/register.py).
API_KEY_VARIABLE = "VLLM_API_KEY"


@dataclass(frozen=True)
class Launch:
    """What to exec: argv plus the environment changes on top of the inherited one."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Set only where the inherited environment does not (an operator's OMP_NUM_THREADS wins, as in vLLM).
    env_defaults: dict[str, str] = field(default_factory=dict)

    def shown_env(self) -> dict[str, str]:
        """`env` (over `env_defaults`) for printing: the API key masked."""
        shown = {**self.env_defaults, **self.env}
        return {key: "<secret>" if key == API_KEY_VARIABLE else value for key, value in shown.items()}

    def environment(self, inherited: Mapping[str, str]) -> dict[str, str]:
        merged = dict(self.env_defaults)
        merged.update((key, value) for key, value in inherited.items() if key not in OWN_VLLM_VARIABLES)
        merged.update(self.env)
        return merged


def build_launch(settings: ReplicaSettings, device: str | None) -> Launch:
    """The replica's command for its `device` (a GPU index, or a CPU core set in CPU mode).

    `device` None: a GPU the scheduler gave the container (Kubernetes' nvidia.com/gpu). The runtime exposes
    only that GPU, so CUDA_VISIBLE_DEVICES is left as the runtime set it (unset: the one GPU it shows).
    """
    argv = [
        "vllm", "serve", settings.base_model,
        "--host", settings.replica_host,
        "--port", str(settings.replica_port),
        "--enable-lora",
        "--max-lora-rank", str(settings.max_lora_rank),
        "--max-loras", str(settings.max_loras),
        "--max-model-len", str(settings.max_model_len),
        "--dtype", served_dtype(settings),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--worker-extension-cls", EXTENSION_CLASS,  # attestation (lora_identity.py), called through dev mode
    ]  # fmt: skip
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}
    defaults: dict[str, str] = {}
    if settings.proxy_upstream_token:
        env[API_KEY_VARIABLE] = settings.proxy_upstream_token
    if settings.replica_device == "gpu":
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        argv += ["--gpu-memory-utilization", str(settings.vllm_gpu_memory_utilization)]
        defaults = sampler_defaults()
    else:
        if device is None:
            raise ValueError("CPU mode needs a core set to bind vLLM's threads to")
        env["VLLM_CPU_OMP_THREADS_BIND"] = device
        # TRL's rollout worker seeds every completion. vLLM rewinds a seeded request's generator after a step that
        # prefilled only part of its prompt, and a CPU torch.Generator has no offset to rewind: the engine core died
        # (`CPU Generator does not use offset`, vllm/v1/worker/gpu_model_runner.py) on the first seeded prompt that
        # did not fit the rest of a step's token budget. Without chunked prefill a prompt is prefilled in one step
        # (vLLM raises the budget to the context length); CUDA generators rewind, so GPU replicas keep it.
        argv += ["--kv-cache-memory-bytes", str(settings.vllm_cpu_kv_cache_bytes), "--no-enable-chunked-prefill"]
        if settings.vllm_cpu_executor == "uni":
            # vLLM's CPU platform swaps `uni` for its multiprocess executor unless V1 multiprocessing is off
            # (vllm/platforms/cpu.py). `vllm serve` keeps its engine core in a process of its own either way
            # (AsyncLLM does not read the variable); only the extra worker process, and its busy-polling of the
            # engine's shared-memory queue after every step, goes (make bench-replica measures both).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            argv += ["--distributed-executor-backend", "uni"]
            defaults = omp_binding(device)
    argv += shlex.split(settings.vllm_extra_args)
    return Launch(argv=argv, env=env, env_defaults=defaults)


def served_dtype(settings: ReplicaSettings) -> str:
    """The `--dtype` vLLM gets: VLLM_DTYPE, with `auto` resolved to float32 on CPU.

    vllm-cpu 0.31 resolves `auto` to bfloat16 on a CPU with AVX512-BF16 or AMX, which breaks the exact logprob
    agreement with the trainer: it trains in float32 on CPU (TRAINER_PRECISION=auto). Such a replica was also reported
    to lose its engine core at its first completion (issue 56; not reproduced on vllm-cpu 0.31 here). On GPU `auto`
    is vLLM's own choice.
    """
    if settings.vllm_dtype == "auto" and settings.replica_device == "cpu":
        return "float32"
    return settings.vllm_dtype


def sampler_defaults() -> dict[str, str]:
    """FlashInfer's top-k/top-p sampler off where FlashInfer is not installed (a GPU host staged without it,
    docs/guides/gpu-processes.md#staging-onto-an-offline-gpu-host).

    CUDA vLLM uses that sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, and importing it without FlashInfer fails
    (vllm/v1/sample/ops/topk_topp_sampler.py); its own sampler serves instead. An operator's setting wins.
    """
    if importlib.util.find_spec("flashinfer") is None:
        return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return {}


def core_ids(core_set: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]: the core-set syntax of VLLM_CPU_SETS."""
    cores: list[int] = []
    for item in core_set.split(","):
        first, _, last = item.strip().partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def omp_binding(core_set: str) -> dict[str, str]:
    """OpenMP's thread count and binding for a `uni` CPU replica: one thread per core of its set, bound to them.

    vLLM applies VLLM_CPU_OMP_THREADS_BIND only when it spawns an `mp` worker (vllm/utils/ompmultiprocessing.py
    sets OMP_NUM_THREADS, OMP_PLACES and OMP_PROC_BIND for that child). Under `uni` nothing does: the engine core ran
    the model with torch's default of one OpenMP thread per core of the machine, unbound, whose spinning helpers
    fought the scheduler, the output thread and the API server for the same cores (3.5x fewer streamed rollouts
    than `mp` in make bench-sync). These are the variables vLLM gives its worker, so `uni` runs the model as `mp`
    does; libgomp binds each process that loads it (API server and engine core) to the set at start-up.
    """
    cores = core_ids(core_set)
    return {"OMP_NUM_THREADS": str(len(cores)), "OMP_PLACES": "{" + ",".join(map(str, cores)) + "}",
            "OMP_PROC_BIND": "true"}
