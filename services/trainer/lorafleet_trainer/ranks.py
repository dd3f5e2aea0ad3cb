"""Several training ranks on one box: one process per GPU in TRAINER_GPUS (or TRAINER_RANKS processes on CPU).

With more than one rank, `lorafleet-train` becomes the launcher: it starts the ranks (the same command, with
torch.distributed's env:// variables RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), relays stop
signals to them and turns a dead rank into a stopped run. Accelerate reads those variables and joins the
process group (NCCL on GPUs, gloo on CPU); TRL keeps the fleet on rank 0 (rollout worker and every HTTP call)
and has every rank take part in the adapter save (FSDP2 gathers each parameter with `full_tensor()`).

Not torchrun: torchrun sends the survivors of a dead rank SIGTERM, which a rank reads as "checkpoint at the
next step" and then waits in a collective with the dead rank until torchrun's shutdown timeout; it relays one
signal only, so a second SIGTERM cannot force the exit (lifecycle.py); and a SIGKILLed torchrun leaves its
workers running. Here survivors of a dead rank are killed at once (the run resumes from its newest checkpoint),
every signal is relayed, and each rank dies with the launcher (PR_SET_PDEATHSIG). A process started by
torchrun or `accelerate launch` (WORLD_SIZE already set) trains as that rank, without this launcher.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from lorafleet.logs import log_event
from lorafleet.ports import free_port
from lorafleet.settings import ConfigError, TrainerSettings

from lorafleet_trainer import early_stop
from lorafleet_trainer.early_stop import STOP_SIGNALS

log = logging.getLogger(__name__)

Device = Literal["cuda", "cpu"]
Sharding = Literal["none", "fsdp2", "ddp"]
LAUNCHER_PID = "LORAFLEET_LAUNCHER_PID"  # set in every rank this launcher starts
POLL_S = 0.2
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankPlan:
    """How many ranks train, on what, and how they hold the model."""

    world_size: int
    device: Device
    sharding: Sharding  # "none": one plain process, no process group

    @property
    def launched(self) -> bool:
        """Trains in launched rank processes (a process group), not in the entrypoint's own process."""
        return self.sharding != "none"

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def summary(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "sharding": self.sharding,
                "backend": self.backend if self.launched else None}


def choose_sharding(requested: str, device: Device, world_size: int) -> Sharding:
    """TRAINER_SHARDING for `world_size` ranks: auto = FSDP2 on GPUs (the reference's), DDP on CPU, nothing
    for one rank; fsdp2 asked for on one GPU runs that GPU as an FSDP2 rank (checkpoints in FSDP2's format,
    and the same code path as several GPUs for a like-for-like timing).

    On CPU accelerate (1.15) drops an FSDP plugin and runs DDP: its AcceleratorState turns FSDP on only
    for accelerator process groups (MULTI_GPU, ...), not MULTI_CPU, although torch's `fully_shard` itself
    runs on gloo. So fsdp2 on CPU is refused rather than silently replaced.
    """
    if requested == "fsdp2" and device == "cpu":
        raise ConfigError(
            "TRAINER_SHARDING=fsdp2 cannot run on CPU: accelerate enables FSDP only on GPUs and would silently run "
            "DDP; set TRAINER_SHARDING=ddp (or auto) for CPU ranks"
        )
    if world_size == 1:
        return "fsdp2" if requested == "fsdp2" else "none"
    if requested == "auto":
        return "fsdp2" if device == "cuda" else "ddp"
    return requested  # type: ignore[return-value]


def plan_ranks(settings: TrainerSettings, cuda_devices: int) -> RankPlan:
    """The rank layout for `settings` on a machine where torch sees `cuda_devices` GPUs (0 = CPU mode).

    GPUs: one rank per TRAINER_GPUS entry, each visible to the trainer. CPU: TRAINER_RANKS ranks (0 = 1).
    Anything that would train on fewer devices than asked for is a ConfigError naming the settings.
    """
    gpus = settings.trainer_gpu_list
    if cuda_devices:
        world = len(gpus)
        if settings.trainer_ranks and settings.trainer_ranks != world:
            raise ConfigError(
                f"TRAINER_RANKS={settings.trainer_ranks} but TRAINER_GPUS={settings.trainer_gpus} lists {world} "
                f"GPU(s): on GPUs every rank has its own GPU; set TRAINER_RANKS=0 (one per GPU) or change TRAINER_GPUS"
            )
        if world > cuda_devices:
            raise ConfigError(
                f"TRAINER_GPUS={settings.trainer_gpus} lists {world} GPUs but the trainer sees {cuda_devices} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give the trainer "
                f"container those GPUs or shorten TRAINER_GPUS"
            )
        device: Device = "cuda"
    else:
        if len(gpus) > 1:
            raise ConfigError(
                f"TRAINER_GPUS={settings.trainer_gpus} lists {len(gpus)} GPUs but torch sees no CUDA device: on CPU "
                f"the rank count is TRAINER_RANKS (e.g. TRAINER_RANKS={len(gpus)}); leave TRAINER_GPUS at one GPU"
            )
        world, device = settings.trainer_ranks or 1, "cpu"
    return RankPlan(world, device, choose_sharding(settings.trainer_sharding, device, world))


def plan_for(settings: TrainerSettings, context: RankContext, cuda_devices: int) -> RankPlan:
    """The plan this process is part of: its launcher's (WORLD_SIZE given) or the one `settings` ask for."""
    if not context.launched:
        return plan_ranks(settings, cuda_devices)
    device: Device = "cuda" if cuda_devices else "cpu"
    return RankPlan(context.world_size, device,
                    choose_sharding(settings.trainer_sharding, device, context.world_size))


def select_gpus(settings: TrainerSettings, environ: MutableMapping[str, str]) -> None:
    """Make TRAINER_GPUS the GPUs CUDA shows, unless CUDA_VISIBLE_DEVICES already picks them.

    Compose sets CUDA_VISIBLE_DEVICES=TRAINER_GPUS itself; a bare `lorafleet-train` on a GPU box gets the same
    host indices (nvidia-smi's PCI bus order). Must run before anything initialises CUDA.
    """
    if "CUDA_VISIBLE_DEVICES" not in environ:
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(settings.trainer_gpu_list)
        environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def pin_cpu_device(plan: RankPlan, environ: MutableMapping[str, str]) -> None:
    """CPU ranks compute on `cpu`, not accelerate's `cpu:<index>`: transformers loads a checkpoint's optimizer
    with map_location=args.device, and torch cannot restore storage to `cpu:0` (every resume would fail)."""
    if plan.device == "cpu" and plan.world_size > 1:
        environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")


@dataclass(frozen=True)
class RankContext:
    """This process's place among the ranks (rank 0 of 1 when nothing launched it as a rank)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launcher_pid: int | None = None  # the lorafleet launcher that started it; None under torchrun or alone
    launched: bool = False  # started as a rank (by this launcher, torchrun or accelerate: WORLD_SIZE is set)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankContext:
        if "WORLD_SIZE" not in environ:
            return cls()
        launcher = environ.get(LAUNCHER_PID)
        return cls(rank=int(environ.get("RANK", "0")), local_rank=int(environ.get("LOCAL_RANK", "0")),
                   world_size=int(environ["WORLD_SIZE"]), launcher_pid=int(launcher) if launcher else None,
                   launched=True)


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies, however it dies (no rank or rollout child outlives it)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)


def leave_process_group() -> None:
    """Destroy torch.distributed's default group where this process joined one; a no-op elsewhere.

    Called by a rank that returns normally. A rank that reaches interpreter shutdown with its group alive can abort
    there (gloo's worker threads; SIGABRT, "terminate called without an active exception": torch 2.13 on CPU, 3 gloo
    ranks, in 10 of 15 launches), so a run that finished reads as a failed rank; NCCL asks for the same call.
    """
    distributed = sys.modules.get("torch.distributed")  # never imported: no group to leave
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def rank_env(environ: Mapping[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of rank `rank`: torch.distributed's env:// rendezvous on this host."""
    return {
        **environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        LAUNCHER_PID: str(os.getpid()),
    }


def exit_code(returncode: int) -> int:
    """A child's Popen returncode as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class Launcher:
    """Starts `plan.world_size` ranks of `argv`, relays stop signals, and ends the run when a rank fails."""

    def __init__(self, plan: RankPlan, argv: list[str], environ: Mapping[str, str] | None = None,
                 poll_s: float = POLL_S, spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> None:
        self.plan = plan
        self.argv = argv
        self.environ = dict(os.environ if environ is None else environ)
        self.poll_s = poll_s
        self.spawn = spawn
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.signals = 0

    def start(self) -> None:
        port = free_port()
        log_event(log, "launching_ranks", **self.plan.summary(), master_port=port)
        # Each rank in a session of its own: a signal to the launcher's process group (a terminal's Ctrl-C)
        # reaches a rank once, relayed, instead of twice (the second would read as "exit at once").
        for rank in range(self.plan.world_size):
            env = rank_env(self.environ, rank, self.plan.world_size, port)
            self.ranks.append(self.spawn([sys.executable, "-m", "lorafleet_trainer.main", *self.argv], env=env,
                                         start_new_session=True))

    def relay(self, signum: int, _frame: Any = None) -> None:
        """Pass a stop signal to every rank: the first asks for a checkpointed stop, a second forces the exit."""
        self.signals += 1
        log_event(log, "relaying_signal", signal=signal.Signals(signum).name, count=self.signals,
                  ranks=sum(1 for rank in self.ranks if rank.poll() is None))
        for rank in self.ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    def stop_survivors(self) -> None:
        """SIGKILL every rank still running: they wait in a collective a dead rank will never join."""
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
        for rank in self.ranks:
            rank.wait()

    def supervise(self) -> int:
        """Wait for the ranks: 0 when all exit 0, else the first failure's exit code (survivors killed)."""
        while True:
            codes = [rank.poll() for rank in self.ranks]
            failed = [(index, code) for index, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                index, code = failed[0]
                if self.signals < 2:  # after a forced stop, non-zero exits are what was asked for
                    log_event(log, "rank_failed", logging.ERROR, rank=index, exit_code=exit_code(code),
                              action="killing the other ranks (they would wait for it in a collective); its own "
                              "log lines above say why", running=sum(1 for c in codes if c is None))
                self.stop_survivors()
                return exit_code(code)
            if all(code == 0 for code in codes):
                log_event(log, "ranks_finished", world_size=self.plan.world_size)
                return 0
            time.sleep(self.poll_s)

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.relay)
        if (held := early_stop.take()) is not None:  # stopped while it started: no rank to start or stop
            log_event(log, "stopped", reason="signal", signal=signal.Signals(held).name, step=None)
            return 0
        try:
            self.start()
            return self.supervise()
        finally:
            self.stop_survivors()
