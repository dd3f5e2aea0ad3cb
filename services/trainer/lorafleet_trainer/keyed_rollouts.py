"""The run key on TRL's rollout requests (TRL 1.16's `AsyncRolloutWorker`, which has no header setting).

The worker spawns a child process that builds `worker._loop_cls(**worker._loop_kwargs, ...)` and posts every
completion through the `aiohttp.ClientSession` that `_AsyncRolloutLoop._run_loops` opens, without headers. A patch
made in the parent never reaches a spawned child, so the key travels the way TRL sends everything else to it: the
worker's `_loop_cls` becomes `KeyedRolloutLoop` (pickled by reference: the child imports it from this module) and the
key rides in `_loop_kwargs` (pickled through the spawn pipe, never an environment variable, which the child's
environment scrub would not touch anyway). `KeyedRolloutLoop` pops the key and sets it as a default header of the
session the moment TRL stores it in `self.session`, so every request on it carries the key and TRL's own code runs
unchanged. TRL's private names are checked at start: a TRL without them refuses to start rather than sending no key.

A module of its own because it imports TRL's rollout worker at load time; main.py imports it only when a key is set.
"""

from __future__ import annotations

import inspect
from typing import Any

from lorafleet.settings import ConfigError
from trl.experimental.async_grpo import async_rollout_worker as trl_worker

from lorafleet_trainer.run_key import KEY_FILE_VARIABLE, bearer

RUN_KEY_KWARG = "run_key"  # the loop kwarg that carries the key into the child
# TRL's loop class; `object` only so that a TRL without it still imports this module and check_rollout_hooks says so.
_TRL_LOOP: Any = getattr(trl_worker, "_AsyncRolloutLoop", object)


class RunKeyUnsupported(RuntimeError):
    """The trainer's rollout worker is not the TRL 1.16 worker the run key is wired into."""


class KeyedRolloutLoop(_TRL_LOOP):
    """TRL's rollout loop whose HTTP session sends the run key on every request (runs in the spawned child)."""

    def __init__(self, *, run_key: str = "", **loop_kwargs: Any) -> None:
        self._run_key = run_key  # before TRL's __init__, which assigns self.session
        super().__init__(**loop_kwargs)

    @property
    def session(self) -> Any:
        return self.__dict__.get("_keyed_session")

    @session.setter
    def session(self, session: Any) -> None:
        """TRL stores the session it opened in `_run_loops` here, before its first request."""
        if session is not None:
            session.headers.update(bearer(getattr(self, "_run_key", "")))
        self.__dict__["_keyed_session"] = session


def _uses_session(function: Any) -> bool:
    try:
        return "self.session" in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def check_rollout_hooks() -> None:
    """Raise ConfigError unless TRL's rollout worker has what KeyedRolloutLoop relies on (TRL 1.16's names)."""
    loop_cls = getattr(trl_worker, "_AsyncRolloutLoop", None)
    worker_cls = getattr(trl_worker, "AsyncRolloutWorker", None)
    hooks = {
        "_AsyncRolloutLoop": loop_cls is not None and loop_cls is _TRL_LOOP,
        "AsyncRolloutWorker._loop_cls": loop_cls is not None and getattr(worker_cls, "_loop_cls", None) is loop_cls,
        "_AsyncRolloutLoop._run_loops storing self.session": _uses_session(getattr(loop_cls, "_run_loops", None)),
        "_AsyncRolloutLoop._post posting on self.session": _uses_session(getattr(loop_cls, "_post", None)),
    }
    missing = [name for name, present in hooks.items() if not present]
    if missing:
        raise ConfigError(
            f"{KEY_FILE_VARIABLE} is set, but this TRL's rollout worker lacks {', '.join(missing)} "
            "(lorafleet wires the run key into TRL 1.16's): its rollouts could not send the run key"
        )


def send_run_key(trainer: Any, run_key: str) -> None:
    """Make the rollout child that `trainer` spawns at train begin send `run_key`; no key, nothing changes.

    Call it after the trainer is built and before `trainer.train()` (TRL starts the worker in on_train_begin).
    """
    if not run_key:
        return
    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        if trainer.accelerator.is_main_process:  # TRL builds the worker on rank 0 only
            raise RunKeyUnsupported("rank 0 has no rollout worker to give the run key to")
        return
    if not isinstance(worker, trl_worker.AsyncRolloutWorker) or worker._loop_cls is not trl_worker._AsyncRolloutLoop:
        raise RunKeyUnsupported(
            f"the rollout worker ({type(worker).__name__}, loop {getattr(worker, '_loop_cls', None)!r}) is not TRL's "
            "AsyncRolloutWorker with its own loop: lorafleet cannot make its rollouts send the run key"
        )
    if not isinstance(getattr(worker, "_loop_kwargs", None), dict):
        raise RunKeyUnsupported("TRL's rollout worker has no _loop_kwargs: the run key cannot reach its child")
    if getattr(worker, "_process", None) is not None:
        raise RunKeyUnsupported("the rollout worker was started before the run key was given to it")
    worker._loop_cls = KeyedRolloutLoop
    worker._loop_kwargs[RUN_KEY_KWARG] = run_key
