"""The replica's section: how each `vllm serve` is started and which device it claims."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator

from lorafleet.settings.common import CommonSettings, ReplicaKey, check_gpu_ids, csv_items

# VLLM_CPU_SETS=auto: core sets from the cores a replica may use (works on any machine, replicas share cores).
AUTO_CPU_SETS = "auto"


class ReplicaSettings(CommonSettings, ReplicaKey):
    """Replicas: the vLLM servers, one per GPU (or core set)."""

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
    vllm_dtype: str = Field(
        "auto", description="--dtype for vLLM (float32 for exact trainer/server logprob ratios); auto = float32 on CPU."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="GPU mode: fraction of the GPU's memory vLLM may use."
    )
    vllm_extra_args: str = Field("", description="Extra arguments appended verbatim to every `vllm serve` command.")

    @field_validator("vllm_gpus")
    @classmethod
    def _gpu_pool_is_ids(cls, value: str) -> str:
        return check_gpu_ids(value)

    @field_validator("vllm_cpu_sets")
    @classmethod
    def _cpu_sets_are_core_lists(cls, value: str) -> str:
        if value.strip() == AUTO_CPU_SETS:
            return value
        sets = csv_items(value, ";")
        if not sets or not all(re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", item) for item in sets):
            raise ValueError("must be core sets separated by ';', each like 0 or 0-3 or 0,2")
        return value

    @property
    def gpu_pool(self) -> list[str]:
        return csv_items(self.vllm_gpus)

    @property
    def cpu_pool(self) -> list[str]:
        """VLLM_CPU_SETS as core sets; `auto`: each core this process may run on (its cgroup's cpuset)."""
        if self.cpu_sets_auto:
            return [str(core) for core in sorted(os.sched_getaffinity(0))]
        return csv_items(self.vllm_cpu_sets, ";")

    @property
    def cpu_sets_auto(self) -> bool:
        return self.vllm_cpu_sets.strip() == AUTO_CPU_SETS
