"""The nemesis: a seeded stream of faults, and their injection into live services.

A fault is drawn from the seed alone (its moment, kind, target and how long it holds), so `make chaos SEED=n`
replays the same stream against the same form. Its moment is measured in training progress, not seconds: the steps
the runs have logged together (prompts.jsonl lines, rolled-back ones included, so the count only grows). The same
seed then strikes at the same points of the runs on a fast machine and a loaded one, and a form's faults up to its
total steps are all injected; which phase each one met (a checkpoint being written, a sync, a restart) depends on
the machine and is recorded as met. Kinds:

- `sigkill`: the target's process group, as a crash or `docker kill`; the supervisor restarts it as Compose would;
- `sigstop`: the process group frozen for `hold_s` (SIGSTOP, then SIGCONT), a hung host;
- `partition`: the relay between the proxy and a replica cut for `hold_s` (relay.Relay).

Faults are injected one at a time: a held one ends before the next begins.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lorafleet.logs import log_event

from lorafleet_ops.chaos.relay import Relay
from lorafleet_ops.chaos.supervisor import Supervised

KINDS = ("sigkill", "sigstop", "partition")


@dataclass(frozen=True)
class Fault:
    at_step: float  # the runs' logged steps, together, when it strikes
    kind: str
    target: str
    hold_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def fault_stream(seed: int, targets: Mapping[str, tuple[str, ...]], mean_gap_steps: float,
                 max_hold_s: float) -> Iterator[Fault]:
    """Faults without end, from `seed` alone: `targets` maps a service name to the kinds it may suffer."""
    rng = random.Random(seed)
    names = sorted(targets)
    at = 0.0
    while True:
        at += rng.expovariate(1 / mean_gap_steps)
        target = rng.choice(names)
        kind = rng.choice(targets[target])
        hold = round(rng.uniform(1.0, max_hold_s), 2) if kind != "sigkill" else 0.0
        yield Fault(round(at, 2), kind, target, hold)


class Nemesis:
    """Injects a fault stream into the supervised services until `done()`; records each fault with its phase."""

    def __init__(self, faults: Iterator[Fault], services: Mapping[str, Supervised], relays: Mapping[str, Relay],
                 phase: Callable[[str], str], log: Any) -> None:
        self.faults, self.services, self.relays, self.phase, self.log = faults, services, relays, phase, log
        self.applied: list[dict[str, Any]] = []

    def run(self, done: Callable[[], bool], progress: Callable[[], int]) -> None:
        started = time.monotonic()
        for fault in self.faults:
            while progress() < fault.at_step:
                if done():
                    return
                time.sleep(0.1)
            if done():
                return
            self.inject(fault, time.monotonic() - started)

    def inject(self, fault: Fault, elapsed_s: float) -> None:
        service = self.services[fault.target]
        phase = self.phase(fault.target)
        self.applied.append({**fault.as_json(), "phase": phase, "elapsed_s": round(elapsed_s, 1)})
        log_event(self.log, "chaos_fault", kind=fault.kind, target=fault.target, phase=phase, hold_s=fault.hold_s)
        if fault.kind == "sigkill":
            service.kill()
        elif fault.kind == "sigstop":
            service.service.signal_group(signal.SIGSTOP)
            time.sleep(fault.hold_s)
            service.service.signal_group(signal.SIGCONT)
        elif fault.kind == "partition":
            relay = self.relays[fault.target]
            relay.cut()
            time.sleep(fault.hold_s)
            relay.heal()
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}: one of {', '.join(KINDS)}")
