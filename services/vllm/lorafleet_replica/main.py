"""`lorafleet-replica`: claim a device, build the `vllm serve` command from the settings, exec vLLM.

Exec (not a child process) so that container signals reach vLLM directly and the device lock,
an inherited descriptor, lives exactly as long as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from lorafleet.adapters import fleet_dir
from lorafleet.logs import configure, log_event
from lorafleet.settings import ConfigError, Settings, load_settings

from lorafleet_replica.claim import Claim, NoFreeDevice, claim_device
from lorafleet_replica.command import Launch, build_launch

log = logging.getLogger("lorafleet_replica")

EXIT_CONFIG = 2
EXIT_NO_DEVICE = 3


# VLLM_CPU_SETS=auto: replicas per core once every core has one (a 2-core machine still runs `--scale vllm-cpu=3`).
AUTO_CPU_SHARES = 4


def claim_for(settings: Settings) -> Claim:
    """Claim a GPU from VLLM_GPUS, or a core set from VLLM_CPU_SETS in CPU mode (shared when it is `auto`)."""
    if settings.replica_device == "gpu":
        pool, variable, shares = settings.gpu_pool, "VLLM_GPUS", 1
    else:
        pool, variable = settings.cpu_pool, "VLLM_CPU_SETS"
        shares = AUTO_CPU_SHARES if settings.cpu_sets_auto else 1
    return claim_device(pool, fleet_dir(settings.adapter_root) / "claims", kind=settings.replica_device,
                        pool_variable=variable, shares=shares)


def resolve_vllm(argv: list[str]) -> list[str]:
    """Prefer the `vllm` next to this interpreter (a venv need not be on PATH), else PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(argv[0], path=search)
    if found is None:
        raise FileNotFoundError(f"`{argv[0]}` not found next to {sys.executable} or on PATH: is vLLM installed?")
    return [found, *argv[1:]]


def offline_for_local_model(settings: Settings, launch: Launch) -> Launch:
    """A base model given as a local directory needs no Hub access: keep the Hub client offline."""
    if Path(settings.base_model).is_dir():
        return Launch(argv=launch.argv, env={**launch.env, "HF_HUB_OFFLINE": "1"})
    return launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet-replica", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print device, environment and command as JSON, exit")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"lorafleet-replica: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure("replica", settings.log_level)
    try:
        claim = claim_for(settings)
    except NoFreeDevice as exc:
        log_event(log, "no_free_device", logging.ERROR, reason=str(exc))
        print(f"lorafleet-replica: {exc}", file=sys.stderr)
        return EXIT_NO_DEVICE
    launch = offline_for_local_model(settings, build_launch(settings, claim.device))
    if args.dry_run:
        print(json.dumps({"device": claim.device, "lock": str(claim.lock_path), "env": launch.shown_env(),
                          "argv": launch.argv}, indent=2))
        return 0
    command = resolve_vllm(launch.argv)
    log_event(log, "exec_vllm", device=claim.device, mode=settings.replica_device, lock=claim.lock_path,
              max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank, command=" ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, launch.environment(os.environ))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
