"""What the stack test runs: the device layout, the env file it writes, and readers of what it observes.

Pure functions only (no Docker), so `make test` proves them: tests/compose/test_stack_env.py renders the
env file with the real Compose binary and the settings schema.

Device layout (issue 17, problems 1 and 2): the trainer gets the first detected GPU; every other GPU goes
to the replicas' pool, which must hold one GPU per replica plus one for the scale-out test. So N replicas
need N + 2 GPUs, and the pool is never left at the default `0` (the trainer's GPU). The cpu profile keeps the
default `VLLM_CPU_SETS=auto`, as a user's `.env` does: one core per replica, shared once every core has one.

The env file is made the way a user makes it (docs/guides/gpu-stack.md#the-env-file): `cp .env.example .env`, then
the two keys set, plus what a test run must choose itself (its own project name and public port, the GPU layout, a
training run that lasts until it is stopped).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lorafleet.ports import free_port

Profile = Literal["gpu", "cpu"]

# Replica service per profile (compose.yaml) and the variable each vLLM process gets its claimed device in.
REPLICA_SERVICE: dict[str, str] = {"gpu": "vllm", "cpu": "vllm-cpu"}
TRAINER_SERVICE: dict[str, str] = {"gpu": "trainer", "cpu": "trainer-cpu"}
DEVICE_VARIABLE: dict[str, str] = {"gpu": "CUDA_VISIBLE_DEVICES", "cpu": "VLLM_CPU_OMP_THREADS_BIND"}
# A small public instruct model: minutes to download and load, room for several replicas on any GPU.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# Where the cpu profile's tiny model is built (inside the adapters volume, read-only for the replicas): compose.yaml's
# default BASE_MODEL for the cpu profile, built by its one-shot `tiny-model` service.
TINY_MODEL_DIR = "/adapters/models/tiny"
RUN_NAME = "stack"
SCALE_SPARE = 1  # devices kept free in the pool for the scale-out test


class NotEnoughDevices(RuntimeError):
    """This host cannot run the requested layout; the message says what it has and what is needed."""


@dataclass(frozen=True)
class StackPlan:
    """One stack run: its Compose project, devices, ports and settings (everything the env file holds)."""

    profile: Profile
    project: str
    replicas: int
    public_port: int
    api_key: str
    base_model: str
    upstream_token: str = ""  # the replicas' vLLM API key, which the proxy sends (PROXY_UPSTREAM_TOKEN)
    trainer_gpus: tuple[str, ...] = ()
    replica_pool: tuple[str, ...] = ()  # VLLM_GPUS (gpu) or VLLM_CPU_SETS (cpu)
    settings: dict[str, str] = field(default_factory=dict)  # training/serving settings of this profile

    @property
    def replica_service(self) -> str:
        return REPLICA_SERVICE[self.profile]

    @property
    def trainer_service(self) -> str:
        return TRAINER_SERVICE[self.profile]

    @property
    def public_url(self) -> str:
        return f"http://127.0.0.1:{self.public_port}"

    def env(self) -> dict[str, str]:
        """What the test sets in `.env` after `cp .env.example .env`; everything else keeps the example's value."""
        values = {
            "COMPOSE_PROJECT_NAME": self.project,
            "REPLICAS": str(self.replicas),
            "PROXY_API_KEY": self.api_key,
            "PROXY_UPSTREAM_TOKEN": self.upstream_token,
            "PROXY_PUBLIC_PORT": str(self.public_port),
            "RUN_NAME": RUN_NAME,
            **self.settings,
        }
        if self.profile == "gpu":
            values["BASE_MODEL"] = self.base_model
            values["TRAINER_GPUS"] = ",".join(self.trainer_gpus)
            values["VLLM_GPUS"] = ",".join(self.replica_pool)
        return values

    def write_env_file(self, directory: Path) -> Path:
        """`<directory>/.env` from `<directory>/.env.example`, as a user makes it (see `user_env_file`)."""
        path = directory / ".env"
        path.write_text(user_env_file((directory / ".env.example").read_text(), self.env()))
        path.chmod(0o600)  # holds the API keys
        return path


def user_env_file(example: str, values: dict[str, str]) -> str:
    """`.env.example` with each variable of `values` set where the example has it (set or commented out), the
    others appended: `cp .env.example .env` and an editor, without the editor."""
    left = dict(values)
    lines = []
    for line in example.splitlines():
        match = re.match(r"^#? ?([A-Z][A-Z0-9_]*)=", line)
        if match and match.group(1) in left:
            line = f"{match.group(1)}={left.pop(match.group(1))}"
        lines.append(line)
    lines += [f"{name}={value}" for name, value in left.items()]
    return "\n".join(lines) + "\n"


def gpu_layout(gpus: list[str], replicas: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(trainer GPUs, replica pool): the first GPU trains, the rest serve; the pool has room for one more replica."""
    needed = 1 + replicas + SCALE_SPARE
    if len(gpus) < needed:
        raise NotEnoughDevices(
            f"needs {needed} GPUs (1 trainer + {replicas} replicas + {SCALE_SPARE} for the scale-out), "
            f"found {len(gpus)}"
        )
    return (gpus[0],), tuple(gpus[1:])


def cpu_layout(cores: int, replicas: int) -> tuple[str, ...]:
    """The cores VLLM_CPU_SETS=auto hands out (replicas share them once each has one): at least two, so that
    replicas are spread over distinct cores before they share."""
    if cores < 2:
        raise NotEnoughDevices(f"needs 2 CPU cores for {replicas} replicas + {SCALE_SPARE} on distinct cores first, "
                               f"found {cores} core(s)")
    return tuple(str(core) for core in range(cores))


def gpu_settings() -> dict[str, str]:
    """A math-recipe run on the real model, one adapter version per step, until the test stops it; room for a second
    run (`make train RUN=b`, the proxy-outage step)."""
    return {"TRAINER_TASK": "math", "FLEET_MAX_RUNS": "2", "MAX_MODEL_LEN": "1024", "MAX_COMPLETION_LENGTH": "256",
            "NUM_GENERATIONS": "4", "TOKEN_BUDGET": "0", "TRAIN_BATCH_SIZE": "8", "GRADIENT_ACCUMULATION_STEPS": "1",
            "WEIGHT_SYNC_STEPS": "1", "SAVE_STEPS": "3", "MAX_STEPS": "1000", "VLLM_GPU_MEMORY_UTILIZATION": "0.6"}


def cpu_settings() -> dict[str, str]:
    """The cpu profile's own defaults (tiny model and recipe, float32: replicas agree to ~1e-6), a run that lasts
    until the test stops it, a checkpoint every few steps, and room for a second run (the proxy-outage step)."""
    return {"MAX_STEPS": "1000", "SAVE_STEPS": "3", "FLEET_MAX_RUNS": "2"}


def unique_project() -> str:
    """A Compose project name of its own: parallel runs and a developer's `lorafleet` stack are untouched."""
    return f"lorafleet-stacktest-{os.getpid()}-{secrets.token_hex(3)}"


def plan_stack(profile: Profile, *, replicas: int, gpus: list[str] | None = None, cores: int | None = None,
               model: str | None = None, project: str | None = None, public_port: int | None = None) -> StackPlan:
    """The layout for this host, or NotEnoughDevices saying why it cannot run here."""
    common: dict[str, Any] = {"profile": profile, "project": project or unique_project(), "replicas": replicas,
                              "public_port": public_port or free_port(), "api_key": secrets.token_hex(16),
                              "upstream_token": secrets.token_hex(16)}
    if profile == "gpu":
        trainer, pool = gpu_layout(gpus or [], replicas)
        return StackPlan(**common, base_model=model or DEFAULT_GPU_MODEL, trainer_gpus=trainer, replica_pool=pool,
                         settings=gpu_settings())
    return StackPlan(**common, base_model=model or TINY_MODEL_DIR, replica_pool=cpu_layout(cores or 1, replicas),
                     settings=cpu_settings() if model is None else {**cpu_settings(), "BASE_MODEL": model})


# --- readers of what the running stack shows -----------------------------------------------------------------


def parse_gpu_indices(query_gpu_csv: str) -> dict[str, str]:
    """`nvidia-smi --query-gpu=index,uuid --format=csv,noheader` -> {uuid: index}."""
    found = {}
    for line in query_gpu_csv.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[parts[1]] = parts[0]
    return found


def parse_compute_apps(compute_apps_csv: str) -> dict[int, str]:
    """`nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader` -> {host pid: GPU uuid}."""
    found = {}
    for line in compute_apps_csv.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[int(parts[0])] = parts[1]
    return found


def parse_top_pids(docker_top: str) -> set[int]:
    """`docker top <container> -eo pid` -> the container's processes as host pids (header line skipped)."""
    return {int(word) for word in docker_top.split() if word.isdigit()}


def gpus_held(
    container_pids: dict[str, set[int]], apps: dict[int, str], index_of: dict[str, str]
) -> dict[str, set[str]]:
    """Container -> the GPU indices its processes have CUDA contexts on (what the hardware says, not the logs)."""
    return {name: {index_of.get(apps[pid], apps[pid]) for pid in pids if pid in apps}
            for name, pids in container_pids.items()}


def device_from_environ(environ: str, profile: Profile) -> str | None:
    """The device the replica's vLLM runs on: its PID 1 environment (`/proc/1/environ`, NUL-separated)."""
    wanted = DEVICE_VARIABLE[profile] + "="
    for entry in environ.split("\0"):
        if entry.startswith(wanted):
            return entry[len(wanted):]
    return None


def ready_urls(fleet: dict[str, Any]) -> list[str]:
    return [replica["url"] for replica in fleet.get("replicas", []) if replica.get("state") == "ready"]


def ledger(fleet: dict[str, Any]) -> dict[str, str]:
    return {entry["name"]: entry["path"] for entry in fleet.get("ledger", [])}


def unsynced(fleet: dict[str, Any]) -> dict[str, list[str]]:
    """Ready replicas missing adapters of the ledger (empty when every replica holds every live version)."""
    live = set(ledger(fleet))
    return {replica["url"]: sorted(live - set(replica.get("adapters", {})))
            for replica in fleet.get("replicas", [])
            if replica.get("state") == "ready" and live - set(replica.get("adapters", {}))}


def metric_rows(jsonl: str) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl."""
    return [json.loads(line) for line in jsonl.splitlines() if line.strip().startswith("{")]


def url_host(url: str) -> str:
    match = re.match(r"^https?://([^/:]+)", url)
    return match.group(1) if match else ""
