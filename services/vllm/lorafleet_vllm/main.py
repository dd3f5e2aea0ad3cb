"""`lorafleet-replica`: claim a device, build the `vllm serve` command from the settings, exec vLLM.

Exec (not a child process) so that container signals reach vLLM directly and the device lock,
an inherited descriptor, lives exactly as long as vLLM does. With REPLICA_DEVICE_ASSIGNMENT=scheduler
(Kubernetes) nothing is claimed: the container was given its own device, and the replica uses it as
the runtime exposes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from lorafleet.adapters import fleet_dir
from lorafleet.gpu_sharing import gpu_shares
from lorafleet.logs import configure, log_event
from lorafleet.settings import ConfigError, ReplicaSettings, load_settings

from lorafleet_vllm.claim import Claim, NoFreeDevice, claim_device
from lorafleet_vllm.command import Launch, build_launch
from lorafleet_vllm.gpu_memory import NotEnoughGpuMemory, check_room

log = logging.getLogger("lorafleet_vllm")

EXIT_CONFIG = 2
EXIT_NO_DEVICE = 3
EXIT_NO_GPU_MEMORY = 4


# VLLM_CPU_SETS=auto: replicas per core once every core has one (a 2-core machine still runs `--scale vllm-cpu=3`).
AUTO_CPU_SHARES = 4


def claim_for(settings: ReplicaSettings) -> Claim:
    """Claim a GPU from VLLM_GPUS, or a core set from VLLM_CPU_SETS in CPU mode (shared when it is `auto`).

    A GPU holds as many replicas as fit its memory at VLLM_GPU_MEMORY_UTILIZATION each (lorafleet.gpu_sharing): one
    at the default 0.85, three at 0.3.
    """
    if settings.replica_device == "gpu":
        pool, variable = settings.gpu_pool, "VLLM_GPUS"
        shares = gpu_shares(settings.vllm_gpu_memory_utilization)
    else:
        pool, variable = settings.cpu_pool, "VLLM_CPU_SETS"
        shares = AUTO_CPU_SHARES if settings.cpu_sets_auto else 1
    return claim_device(pool, fleet_dir(settings.adapter_root) / "claims", kind=settings.replica_device,
                        pool_variable=variable, shares=shares)


def core_list(cores: Iterable[int]) -> str:
    """{0, 1, 2, 3, 6} -> "0-3,6": the core-set syntax of VLLM_CPU_SETS and VLLM_CPU_OMP_THREADS_BIND."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def scheduled_device(settings: ReplicaSettings) -> str | None:
    """The device the scheduler gave this container: a GPU as the runtime exposes it (None: nothing to pin), or
    in CPU mode the cores this process may run on (the kubelet's cpuset)."""
    if settings.replica_device == "gpu":
        return None
    return core_list(os.sched_getaffinity(0))


def visible_gpus() -> str:
    """What the container runtime says this container's GPUs are, for the log."""
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return "every GPU the runtime exposes"


def resolve_vllm(argv: list[str]) -> list[str]:
    """Prefer the `vllm` next to this interpreter (a venv need not be on PATH), else PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(argv[0], path=search)
    if found is None:
        raise FileNotFoundError(f"`{argv[0]}` not found next to {sys.executable} or on PATH: is vLLM installed?")
    return [found, *argv[1:]]


def offline_for_local_model(settings: ReplicaSettings, launch: Launch) -> Launch:
    """A base model given as a local directory needs no Hub access: keep the Hub client offline."""
    if Path(settings.base_model).is_dir():
        return dataclasses.replace(launch, env={**launch.env, "HF_HUB_OFFLINE": "1"})
    return launch


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what docs/reference/cli.md is generated from)."""
    parser = argparse.ArgumentParser(prog="lorafleet-replica", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print device, environment and command as JSON, exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(ReplicaSettings)
    except ConfigError as exc:
        print(f"lorafleet-replica: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure("replica", settings.log_level)
    lock: Path | None = None
    if settings.replica_device_assignment == "scheduler":
        device = scheduled_device(settings)
    else:
        try:
            claim = claim_for(settings)
        except NoFreeDevice as exc:
            log_event(log, "no_free_device", logging.ERROR, reason=str(exc))
            print(f"lorafleet-replica: {exc}", file=sys.stderr)
            return EXIT_NO_DEVICE
        device, lock = claim.device, claim.lock_path
    launch = offline_for_local_model(settings, build_launch(settings, device))
    if args.dry_run:
        print(json.dumps({"device": device, "lock": lock and str(lock), "env": launch.shown_env(),
                          "argv": launch.argv}, indent=2))
        return 0
    if settings.replica_device == "gpu":
        try:
            room = check_room(device, settings.vllm_gpu_memory_utilization)
            log_event(log, "gpu_memory", gpu=room.index, free_gib=round(room.free_mib / 1024, 2),
                      total_gib=round(room.total_mib / 1024, 2), fraction=settings.vllm_gpu_memory_utilization)
        except NotEnoughGpuMemory as exc:
            log_event(log, "not_enough_gpu_memory", logging.ERROR, reason=str(exc))
            print(f"lorafleet-replica: {exc}", file=sys.stderr)
            return EXIT_NO_GPU_MEMORY
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # no nvidia-smi here: vLLM's check stands
            log_event(log, "gpu_memory_unknown", logging.WARNING, reason=f"{type(exc).__name__}: {exc}")
    command = resolve_vllm(launch.argv)
    log_event(log, "exec_vllm", device=device or f"scheduler ({visible_gpus()})", mode=settings.replica_device,
              lock=lock, max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank,
              command=" ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, launch.environment(os.environ))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
