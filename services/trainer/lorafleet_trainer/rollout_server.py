"""The process TRL's rollout child comes from: a fork server started early, with the child's imports already done.

TRL 1.16 starts its rollout child with `spawn`: at train begin a fresh interpreter imports torch, transformers and
TRL (`trl.experimental.async_grpo`: about 10 s of CPU, `python -X importtime`), and training waits for it on every
start. The standard library's fork server is a fresh interpreter too (exec'd, never a fork of the trainer, so no
thread, lock or CUDA state of the trainer reaches the child), but `start` launches it as soon as `train()`'s cheap
checks passed (main.py's start phase; a refused start pays none of this): it imports the child's modules while
the trainer imports its own, and at train begin the child is forked from it, ready at once. What spawn gave, it keeps:
- the child's environment is the trainer's when the server starts: `start` comes once it is final (the task file,
  the devices);
- the stop signals are blocked in the server and so in the child (lifecycle.py: the trainer alone decides when the
  child stops);
- nothing outlives the trainer: this module, imported first in the server, has the kernel kill the server when the
  trainer dies, and the child asks the same of the server.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import ForkServerContext, ForkServerProcess

from lorafleet.logs import stacks_on_sigusr1

from lorafleet_trainer.early_stop import STOP_SIGNALS
from lorafleet_trainer.ranks import die_with_parent

TRAINER_PID_ENV = "LORAFLEET_ROLLOUT_SERVER_PARENT"  # the trainer that started the server (inherited by it)
CHILD_MODULES = ("lorafleet_trainer.fleet_rollouts",)  # TRL's rollout worker and the loop the child runs


def start() -> None:
    """Start the server (nothing if it runs): stop signals blocked, the child's modules imported in it."""
    os.environ[TRAINER_PID_ENV] = str(os.getpid())
    multiprocessing.set_forkserver_preload([__name__, *CHILD_MODULES])
    resource_tracker.ensure_running()  # starting it inside the block would unblock both signals again
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:  # signals that arrived meanwhile are delivered to the trainer now
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ShieldedProcess(ForkServerProcess):
    """A process forked from the server: stop signals blocked, and dead when the server (so the trainer) is."""

    def start(self) -> None:
        start()
        super().start()

    def run(self) -> None:
        die_with_parent(os.getppid())  # the server
        stacks_on_sigusr1()  # its stacks on demand, as the trainer's
        trainer = multiprocessing.parent_process()
        if trainer is not None and not trainer.is_alive():  # it died before the server's death could reach us
            os._exit(1)
        super().run()


class ShieldedContext(ForkServerContext):
    Process = ShieldedProcess


def _in_the_server() -> bool:
    """True in the fork server this module's `start` launched (`python -c`, a child of the trainer named in env)."""
    return sys.argv == ["-c"] and os.environ.get(TRAINER_PID_ENV) == str(os.getppid())


if _in_the_server():
    die_with_parent(os.getppid())
