"""The nemesis: a seeded stream of faults, and their injection into live services.

A fault is drawn from the seed alone (its moment, kind, target and how long it holds), so `make chaos SEED=n`
replays the same stream against the same form. Its moment is measured in training progress, not seconds: the steps
the runs have logged together (prompts.jsonl lines, rolled-back ones included, so the count only grows). The same
seed then strikes at the same points of the runs on a fast machine and a loaded one, and a form's faults up to its
total steps are all injected; which phase each one met (a checkpoint being written, a sync, a restart) depends on
the machine and is recorded as met. Kinds:

- `sigkill`: the target's process group, as a crash or `docker kill`; the supervisor restarts it as Compose would;
- `sigstop`: the process group frozen for `hold_s` (SIGSTOP, then SIGCONT), a hung host;
- `partition`: the relay between the proxy and a replica cut for `hold_s` (relay.Relay);
- `scale`: a replica removed the way `docker compose up --scale` removes one (SIGTERM, then gone: not restarted), or
  one added in an empty slot (`action` up or down). The proxy's PROXY_UPSTREAMS list every slot's relay, as a
  Compose file that names the replicas does: a slot with no replica refuses connections (the relay resets them) and
  the proxy ejects it; a replica started there is admitted as a returning one, synced before it gets traffic.
  Which way each goes is drawn with the stream, so the seed alone decides it; at least one replica stays;
- `disk_full`: the trainer's run folder (its own tmpfs, disk.RunDisk) filled to TRAINER_MIN_FREE_GB for `hold_s`:
  the trainer stops with a checkpoint (exit 0, `event=stopped reason=low_disk`) or refuses to start (exit 3), and is
  started again once the space is freed, as an operator would.

Faults are injected one at a time: a held one ends before the next begins. A removed replica suffers no fault until
it is added back.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lorafleet.logs import log_event

from lorafleet_testing.chaos.disk import RunDisk
from lorafleet_testing.chaos.relay import Relay
from lorafleet_testing.chaos.supervisor import Supervised

KINDS = ("sigkill", "sigstop", "partition", "scale", "disk_full")
HELD = ("sigstop", "partition", "disk_full")  # the kinds that hold for hold_s
REPLICA = "replica-"


@dataclass(frozen=True)
class Fault:
    at_step: float  # the runs' logged steps, together, when it strikes
    kind: str
    target: str
    hold_s: float = 0.0
    action: str = ""  # a scale fault's: "up" or "down"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def fault_stream(seed: int, targets: Mapping[str, tuple[str, ...]], mean_gap_steps: float,
                 max_hold_s: float, absent: Iterable[str] = ()) -> Iterator[Fault]:
    """Faults without end, from `seed` alone: `targets` maps a service name to the kinds it may suffer; `absent`
    names the replica slots empty at the start (scaling adds and removes replicas from then on)."""
    rng = random.Random(seed)
    out = set(absent)
    slots = sorted(name for name in targets if name.startswith(REPLICA))
    if any("scale" in kinds for kinds in targets.values()) and len(slots) < 2:
        raise ValueError(f"scale faults need at least 2 replica slots, not {slots}")
    at = 0.0
    while True:
        at += rng.expovariate(1 / mean_gap_steps)
        target = rng.choice(sorted(set(targets) - out))
        kind = rng.choice(targets[target])
        action = ""
        if kind == "scale":
            target, action = _scaled(rng, target, [slot for slot in slots if slot not in out], out)
        hold = round(rng.uniform(1.0, max_hold_s), 2) if kind in HELD else 0.0
        yield Fault(round(at, 2), kind, target, hold, action)


def _scaled(rng: random.Random, drawn: str, present: list[str], out: set[str]) -> tuple[str, str]:
    """Which replica a scale fault moves, and which way: an empty slot filled half the time (always when `drawn` is
    the last replica left), else `drawn` removed. `out` follows."""
    if out and (len(present) == 1 or rng.random() < 0.5):
        added = rng.choice(sorted(out))
        out.discard(added)
        return added, "up"
    out.add(drawn)
    return drawn, "down"


class Nemesis:
    """Injects a fault stream into the supervised services until `done()`; records each fault with its phase."""

    def __init__(self, faults: Iterator[Fault], services: Mapping[str, Supervised], relays: Mapping[str, Relay],
                 phase: Callable[[str], str], log: Any, disks: Mapping[str, RunDisk] | None = None) -> None:
        self.faults, self.services, self.relays, self.phase, self.log = faults, services, relays, phase, log
        self.disks = disks or {}  # per trainer service: its run folder's tmpfs
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
        phase = "absent" if fault.action == "up" else self.phase(fault.target)
        self.applied.append({**fault.as_json(), "phase": phase, "elapsed_s": round(elapsed_s, 1)})
        log_event(self.log, "chaos_fault", kind=fault.kind, target=fault.target, phase=phase, hold_s=fault.hold_s,
                  action=fault.action)
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
        elif fault.kind == "scale" and fault.action == "down":
            service.stop()  # SIGTERM, then gone: the supervisor never restarts a stopped service
        elif fault.kind == "scale":
            service.resume()
        elif fault.kind == "disk_full":
            disk = self.disks[fault.target]
            service.held = True  # a start that stops for low disk waits for the space to be freed
            disk.fill()
            time.sleep(fault.hold_s)
            disk.heal()
            service.held = False
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}: one of {', '.join(KINDS)}")
