"""The fast step's clock: forward+backward and forward time of a step that never waits for the GPU.

Used by the sync-free loss (loss.py) and read once per step by the trainer (../fast_trainer.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepTimer:
    """forward+backward and forward time of one optimizer step: CUDA events on a GPU, the host clock elsewhere.

    Without host synchronisation the host returns from a micro-batch long before the GPU has run it, so TRL's host
    clock (`perf/fwd_bwd_s`, `perf/fwd_s`) would time kernel launches. On a GPU `perf/fwd_bwd_s` becomes the GPU
    span from the step's first forward to its last backward (the gaps between micro-batches included) and
    `perf/fwd_s` the sum of the forwards' GPU spans; both are read once per step, after the last backward.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._first: Any = None
        self._last: Any = None
        self._forwards: list[tuple[Any, Any]] = []

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def microbatch_begin(self) -> None:
        if self.cuda and self._first is None:
            self._first = self._event()

    def microbatch_end(self) -> None:
        if self.cuda:
            self._last = self._event()

    def forward(self) -> Any:
        return self._event() if self.cuda else time.perf_counter()

    def forward_done(self, started: Any) -> float:
        """Host seconds of the forward (what TRL logs on CPU); on a GPU the pair is kept for `read`."""
        if self.cuda:
            self._forwards.append((started, self._event()))
            return 0.0
        return time.perf_counter() - started

    def read(self) -> tuple[float, float] | None:
        """(forward+backward s, forward s) of the step on the GPU, then reset; None off the GPU or with no step."""
        first, last, forwards = self._first, self._last, self._forwards
        self._first, self._last, self._forwards = None, None, []
        if not self.cuda or first is None or last is None:
            return None
        last.synchronize()
        return first.elapsed_time(last) / 1e3, sum(a.elapsed_time(b) for a, b in forwards) / 1e3
