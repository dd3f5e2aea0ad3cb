"""The prefetch lever: one rank's micro-batches packed ahead (on a thread, or in packing_process.py's process) and
handed to the training loop with the metrics their packing produced, stale samples judged at the version they will
be trained at.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lorafleet_trainer.fast_step.packing_process import PackingProcess


def put_until_stopped(out: Any, item: Any, stop: Any) -> bool:
    """Put `item` on a bounded queue (a thread's or a process's), waiting while it is full; False once `stop` is set
    (the consumer is gone, nothing would ever take it)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


@dataclass
class StepVersions:
    """The policy version each micro-batch will be trained at, for the staleness check of samples packed ahead.

    TRL syncs (and bumps `model_version`) at the end of every `weight_sync_steps`-th step; micro-batch b of a run
    that started at step g0 with version v0 is trained in step s = g0 + b // GA + 1, at version
    v0 + (s - 1) // weight_sync_steps - g0 // weight_sync_steps. Never below the trainer's current version.
    """

    gradient_accumulation_steps: int
    weight_sync_steps: int
    start_step: int = 0
    start_version: int = 0

    def at(self, batch_index: int, current: int) -> int:
        steps_before = self.start_step + batch_index // self.gradient_accumulation_steps
        syncs = steps_before // self.weight_sync_steps - self.start_step // self.weight_sync_steps
        return max(current, self.start_version + syncs)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class MicroBatchStream:
    """One rank's micro-batches as TRL's dataloader makes them (planner -> collator), optionally packed on a thread.

    `bind(planner, collate)`: `planner` yields one micro-batch's rows at a time (TRL's TokenBudgetBatcher or
    FixedCountBatcher, built with `self.sink` as its metric sink), `collate` is TRL's DataCollatorForRollout built
    with `self.sink` and `self.groups`. Each micro-batch is handed over with the metrics and prompt groups its
    packing produced, to `deliver(metrics, groups)`, when the training loop takes it: so these land in the step
    that trains the micro-batch, as they do in TRL. With `threaded`, packing runs `depth` micro-batches ahead on a
    daemon thread; `wait_s` is then the time the training loop waited for a micro-batch (TRL's
    `perf/rollout_wait_s`). `prepare` runs on the packing side (e.g. `compact_batch`), then tensors are pinned
    (`pin`) and copied to `device` without blocking when taken.
    """

    def __init__(self, *, deliver: Callable[[dict[str, list], set], None], prepare: Callable[[Any], Any] | None = None,
                 threaded: bool = False, depth: int = 1, device: Any = None, pin: bool = False,
                 on_start: Callable[[], None] | None = None, switch_interval_s: float = 0.0) -> None:
        self.sink: dict[str, list] = defaultdict(list)
        self.groups: set[Any] = set()
        self.building = 0  # index of the micro-batch being packed (read by the staleness check)
        self.wait_s = 0.0
        self.deliver, self.prepare, self.threaded, self.depth = deliver, prepare, threaded, max(1, depth)
        self.device, self.pin, self.on_start = device, pin, on_start
        self.switch_interval_s = switch_interval_s
        self.process: PackingProcess | None = None  # set: packing runs in that process instead
        self._planner: Iterable[Any] | None = None
        self._collate: Callable[[list[Any]], Any] | None = None

    def bind(self, planner: Iterable[Any], collate: Callable[[list[Any]], Any]) -> None:
        self._planner, self._collate = planner, collate

    def _packed(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        assert self._planner is not None and self._collate is not None, "bind() the planner and collator first"
        for rows in self._planner:
            batch = self._collate([rows])
            if self.prepare is not None:
                batch = self.prepare(batch)
            if self.pin:
                batch = _map_tensors(batch, lambda tensor: tensor.pin_memory())
            metrics = {key: list(values) for key, values in self.sink.items() if values}
            self.sink.clear()
            groups = set(self.groups)
            self.groups.clear()
            self.building += 1
            yield batch, metrics, groups

    def _to_device(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return _map_tensors(batch, lambda tensor: tensor.to(self.device, non_blocking=True))

    def __iter__(self) -> Iterator[Any]:
        if self.on_start is not None:
            self.on_start()
        if self.process is not None:
            items = self._in_process()
        else:
            items = self._threaded() if self.threaded else self._packed()
        for batch, metrics, groups in items:
            self.deliver(metrics, groups)
            yield self._to_device(batch)

    def _threaded(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        handoff: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            return put_until_stopped(handoff, item, stop)

        def work() -> None:
            try:
                for item in self._packed():
                    if not put(item):
                        return
            except BaseException as exc:  # handed to the training loop, which raises it
                put(_Failure(exc))
            else:
                put(_END)

        thread = threading.Thread(target=work, name="lorafleet-prefetch", daemon=True)
        interval = sys.getswitchinterval()
        if self.switch_interval_s > 0:
            sys.setswitchinterval(self.switch_interval_s)
        thread.start()
        try:
            while True:
                started = time.perf_counter()
                while True:
                    try:
                        item = handoff.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if not thread.is_alive() and handoff.empty():
                            raise RuntimeError("the prefetch thread ended without a micro-batch or an error") from None
                self.wait_s += time.perf_counter() - started
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            sys.setswitchinterval(interval)


    def _in_process(self) -> Iterator[tuple[Any, dict[str, list], set]]:
        """Micro-batches packed by `self.process` (see `PackingProcess`), pinned here, `wait_s` as with a thread."""
        spec = self.process
        assert spec is not None
        spec.start()
        try:
            while True:
                started = time.perf_counter()
                item = spec.get()
                self.wait_s += time.perf_counter() - started
                if item is _END:
                    return
                batch, metrics, groups = item
                if self.pin:
                    batch = _map_tensors(batch, lambda tensor: tensor.pin_memory())
                yield batch, metrics, groups
        finally:
            spec.stop()


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value
