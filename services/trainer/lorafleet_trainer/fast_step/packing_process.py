"""Prefetch in a spawned process: TRL's planner and collator there, reading TRL's rollout queue, so packing (pure
Python) never holds the training process's interpreter lock.

`_pack_in_process` is the spawned process's target: it stays a module-level function (spawn pickles it by name).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lorafleet_trainer.fast_step.loss import compact_batch
from lorafleet_trainer.fast_step.prefetch import _END, MicroBatchStream, StepVersions, put_until_stopped


@dataclass
class PackingProcess:
    """TRL's planner and collator (and `compact_batch`) in a spawned process, reading TRL's rollout queue directly.

    The process builds the same RolloutQueueDataset -> TokenBudgetBatcher / FixedCountBatcher -> collator chain as
    TRL on one rank, with its own metric sink and group set, and sends each micro-batch (tensors as numpy arrays)
    with its metrics and groups; its staleness check is `StepVersions` against the rollout worker's shared version.
    The training process keeps the health check (`idle_check`, every `poll_s` without a micro-batch) and raises
    what the process raised. Rollout traces (report_to) are not logged from there.
    """

    rollout_queue: Any
    version_value: Any  # the rollout worker's shared mp.Value of the policy version
    versions: StepVersions
    pad_token_id: int
    token_budget: int
    batch_size: int
    max_staleness: int
    compact: bool
    depth: int
    idle_check: Callable[[], None] = lambda: None
    poll_s: float = 5.0
    context: Any = None

    def start(self) -> None:
        import multiprocessing
        import multiprocessing.util
        import os

        ctx = self.context or multiprocessing.get_context("spawn")
        self._out = ctx.Queue(maxsize=max(1, self.depth))
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_pack_in_process, name="lorafleet-packer", daemon=True, args=(
            {"rollout_queue": self.rollout_queue, "version_value": self.version_value, "versions": self.versions,
             "pad_token_id": self.pad_token_id, "token_budget": self.token_budget, "batch_size": self.batch_size,
             "max_staleness": self.max_staleness, "compact": self.compact, "parent": os.getpid()},
            self._out, self._stop))
        self._proc.start()
        # At interpreter exit multiprocessing terminates daemonic children (SIGTERM, which the packer ignores) and
        # joins them: stop it first. Finalizers run before that; the training loop may never close the stream.
        multiprocessing.util.Finalize(self, self.stop, exitpriority=10)

    def get(self) -> Any:
        while True:
            try:
                kind, payload = self._out.get(timeout=self.poll_s)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the packing process exited ({self._proc.exitcode}) without an error "
                                       "message") from None
                self.idle_check()
                continue
            if kind == "error":
                raise payload
            if kind == "end":
                return _END
            arrays, metrics, groups = payload
            return _map_arrays(arrays), metrics, groups

    def stop(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        self._proc = None
        self._stop.set()
        proc.join(timeout=2)
        if proc.is_alive():  # blocked on the rollout queue: it holds nothing the trainer still needs
            proc.kill()
            proc.join(timeout=2)


def _to_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.numpy())
    if isinstance(value, dict):
        return {key: _to_arrays(item) for key, item in value.items()}
    return value


def _map_arrays(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
        return torch.from_numpy(value[1])
    if isinstance(value, dict):
        return {key: _map_arrays(item) for key, item in value.items()}
    return value


def _pack_in_process(spec: dict[str, Any], out: Any, stop: Any) -> None:
    """The packing process: TRL's one-rank dataloader chain, each micro-batch sent to `out` (see PackingProcess)."""
    import signal

    from lorafleet_trainer.ranks import die_with_parent

    die_with_parent(spec["parent"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when training stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)

    def send(item: Any) -> bool:
        return put_until_stopped(out, item, stop)

    try:
        from accelerate import PartialState
        from trl.experimental.async_grpo.async_grpo_trainer import (
            DataCollatorForRollout,
            FixedCountBatcher,
            RolloutQueueDataset,
            TokenBudgetBatcher,
        )

        PartialState(cpu=True)  # TRL logs through accelerate, which needs a state; one process, no GPU
        stream = MicroBatchStream(deliver=lambda *_: None, prepare=compact_batch if spec["compact"] else None)
        versions, value = spec["versions"], spec["version_value"]
        samples = RolloutQueueDataset(
            rollout_queue=spec["rollout_queue"],
            model_version_fn=lambda: versions.at(stream.building, int(value.value)),
            check_health_fn=lambda _stale_after_s: None,  # the training process checks the rollout worker
            stale_after_s=0.0,
            metrics=stream.sink,
            max_staleness=spec["max_staleness"],
            report_to=[],
        )
        budget = spec["token_budget"]
        planner: Any = (TokenBudgetBatcher(samples, 1, budget, stream.sink) if budget > 0
                        else FixedCountBatcher(samples, 1, spec["batch_size"]))
        stream.bind(planner, DataCollatorForRollout(spec["pad_token_id"], 1, groups_trained=stream.groups,
                                                    metrics=stream.sink, token_budget=max(budget, 0)))
        for batch, metrics, groups in stream._packed():
            if not send(("batch", (_to_arrays(batch), metrics, groups))):
                return
    except BaseException as exc:  # sent to the training process, which raises it
        try:
            send(("error", exc))
        except Exception:  # unpicklable: its text then
            send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    else:
        send(("end", None))
