"""Stop decisions (signals, per-start ceilings, free space), the start-time refusal (the shielded rollout child:
test_rollout_server.py)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from lorafleet.logs import LogfmtFormatter
from lorafleet_trainer import early_stop
from lorafleet_trainer import stops as lc
from lorafleet_trainer.lifecycle import RunLifecycle
from lorafleet_trainer.stops import GB, Limits, StopDecision, StoppedWhileWaiting

ARGS = SimpleNamespace(save_steps=50)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lifecycle(wall=0.0, steps=0, min_free=0, free=10 * GB, clock=None) -> RunLifecycle:
    limits = Limits(max_wall_s=wall, max_steps=steps, min_free_bytes=min_free, volume=Path("/adapters"))
    return RunLifecycle(StopDecision(limits, clock=clock or Clock(), disk=lambda _: free))


def _step_end(life: RunLifecycle, step: int) -> SimpleNamespace:
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    life.on_step_end(None, SimpleNamespace(global_step=step), control)
    return control


def test_no_limits_never_stop():
    life = _lifecycle()
    life.on_train_begin(ARGS, SimpleNamespace(global_step=0), None)
    controls = [vars(_step_end(life, step)) for step in (1, 2)]
    assert controls == [{"should_save": False, "should_training_stop": False}] * 2
    assert life.stops.reason is None


def test_run_max_steps_counts_steps_of_this_start_only():
    life = _lifecycle(steps=2)
    state = SimpleNamespace(global_step=7, save_steps=1000)  # resumed at step 7 from a run saving every 1000
    life.on_train_begin(SimpleNamespace(save_steps=1), state, None)
    assert state.save_steps == 1  # this start's SAVE_STEPS applies, not the checkpoint's
    assert not _step_end(life, 8).should_training_stop
    control = _step_end(life, 9)
    assert control.should_save and control.should_training_stop
    assert life.stops.reason == lc.MAX_STEPS


def test_run_max_wall_s_counts_from_construction():
    clock = Clock()
    life = _lifecycle(wall=60, clock=clock)
    life.on_train_begin(ARGS, SimpleNamespace(global_step=0), None)
    clock.now += 59.9
    assert not _step_end(life, 1).should_training_stop
    clock.now += 0.1
    assert _step_end(life, 2).should_save
    assert life.stops.reason == lc.MAX_WALL


def test_low_disk_refuses_with_figures_and_stops_with_a_checkpoint():
    life = _lifecycle(min_free=2 * GB, free=GB)
    assert "has 1.00 GB free, under TRAINER_MIN_FREE_GB=2" in life.stops.low_disk()
    life.on_train_begin(ARGS, SimpleNamespace(global_step=0), None)
    assert _step_end(life, 1).should_save
    assert life.stops.reason == lc.LOW_DISK
    assert _lifecycle(min_free=GB, free=GB).stops.low_disk() is None
    assert _lifecycle(min_free=0, free=0).stops.low_disk() is None  # 0 = guard off


def test_free_bytes_measures_the_nearest_existing_parent(tmp_path, monkeypatch):
    # The disk is shared with other work, so its free figure moves between two reads:
    # record which path was measured instead of comparing two live readings.
    measured = []
    real_usage = lc.shutil.disk_usage

    def usage(path):
        measured.append(path)
        return real_usage(path)

    monkeypatch.setattr(lc.shutil, "disk_usage", usage)
    assert lc.free_bytes(tmp_path / "not" / "yet") > 0
    assert measured == [tmp_path]


def test_first_signal_requests_a_checkpointed_stop_second_exits_at_once(monkeypatch):
    life = _lifecycle()
    killed, exits = [], []
    life.stops.on_force = lambda: killed.append(True)
    monkeypatch.setattr(lc.os, "_exit", exits.append)
    life.stops._on_signal(signal.SIGTERM, None)
    assert life.stops.reason == lc.SIGNAL and not killed and not exits
    assert _step_end(life, 3).should_save
    life.stops._on_signal(signal.SIGINT, None)
    assert killed == [True] and exits == [128 + signal.SIGINT]


def test_a_due_stop_abandons_the_rollout_wait_but_health_errors_come_first():
    life = _lifecycle()
    calls = []
    check = life.stops.check_health(calls.append)
    check(300.0)  # nothing due: the wait goes on
    life.stops._on_signal(signal.SIGTERM, None)
    with pytest.raises(StoppedWhileWaiting):
        check(300.0)
    assert calls == [300.0, 300.0]

    def broken(_: float) -> None:
        raise RuntimeError("Rollout worker child has failed")

    with pytest.raises(RuntimeError, match="child has failed"):
        life.stops.check_health(broken)(300.0)


def test_agreement_across_ranks_stops_every_rank():
    life = _lifecycle()
    life.stops.agree = lambda flag: True  # another rank was signalled
    assert _step_end(life, 4).should_training_stop
    assert life.stops.reason == lc.OTHER_RANK


def test_the_trainer_refuses_to_start_on_a_full_volume(tmp_path, monkeypatch):
    from lorafleet_trainer import main

    monkeypatch.setattr(lc, "free_bytes", lambda _: GB // 2)
    env = {"ADAPTER_ROOT": str(tmp_path), "TRAINER_REPLICAS": "1", "TRAINER_MIN_FREE_GB": "1",
           "TRAINER_VLLM_URL": "http://127.0.0.1:9"}  # nothing listens: the fleet is never asked
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main.main([]) == main.EXIT_PREFLIGHT
    assert not (tmp_path / "runs").exists()


class FakeModel:
    """What TRL's adapter writer touches of a PeftModel (the real export is tested in test_run_state.py)."""

    active_adapters = ("default",)

    def state_dict(self) -> dict[str, object]:
        return {}

    def save_pretrained(self, path: str, **kwargs: object) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "adapter_config.json").write_text("{}")


class FakeTrainer:
    """What run_until_stopped touches of AsyncGRPOTrainer: train(), state, args, accelerator, _save_checkpoint."""

    def __init__(self, run: Path, life: RunLifecycle, stop_at: int, raise_in_wait: bool = False) -> None:
        self.args = SimpleNamespace(output_dir=str(run))
        self.state = SimpleNamespace(global_step=0, max_steps=30)
        self.accelerator = SimpleNamespace(is_main_process=True, num_processes=1, unwrap_model=lambda model: model)
        self.model, self.model_version = FakeModel(), 0
        self.life, self.stop_at, self.raise_in_wait = life, stop_at, raise_in_wait

    def train(self, resume_from_checkpoint: str | None = None) -> None:
        self.life.on_train_begin(ARGS, self.state, None)
        while self.state.global_step < self.state.max_steps:
            if self.state.global_step == self.stop_at and self.raise_in_wait:
                self.life.stops._on_signal(signal.SIGTERM, None)
                raise StoppedWhileWaiting(self.life.stops.reason)
            self.state.global_step += 1
            self.model_version += 1
            control = _step_end(self.life, self.state.global_step)
            if control.should_save:
                self._save_checkpoint(self.model, trial=None)
            if control.should_training_stop:
                return

    def _save_checkpoint(self, model: FakeModel, trial: None) -> None:
        path = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text("{}")


@pytest.fixture
def events() -> Iterator[list[str]]:
    """The trainer's log lines, as logfmt (whatever handlers an earlier test configured)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(LogfmtFormatter("trainer").format(record))  # type: ignore[method-assign]
    logger = logging.getLogger("lorafleet_trainer")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_ceiling_checkpoints_exports_the_final_adapter_and_says_why(tmp_path, events):
    from lorafleet_trainer.main import run_until_stopped

    life = _lifecycle(steps=3)
    trainer = FakeTrainer(tmp_path, life, stop_at=-1)
    assert run_until_stopped(trainer, life, None) == 0
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").is_file()
    assert (tmp_path / "final-adapter" / "adapter_config.json").is_file()
    assert "event=stopped reason=run_max_steps step=3" in events[-1]


def test_a_signal_during_the_rollout_wait_checkpoints_the_last_step_without_exporting(tmp_path, events):
    from lorafleet_trainer.main import run_until_stopped

    life = _lifecycle()
    trainer = FakeTrainer(tmp_path, life, stop_at=2, raise_in_wait=True)  # SIGTERM while waiting after step 2
    assert run_until_stopped(trainer, life, None) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-2"]  # no final adapter
    assert "event=stopped reason=signal step=2" in events[-1]


def test_a_signal_before_training_trains_nothing(tmp_path, events):
    from lorafleet_trainer.main import run_until_stopped

    life = _lifecycle()
    life.stops._on_signal(signal.SIGTERM, None)  # during the fleet checks or the model load
    trainer = FakeTrainer(tmp_path, life, stop_at=-1)
    assert run_until_stopped(trainer, life, None) == 0
    assert trainer.state.global_step == 0 and not list(tmp_path.iterdir())
    assert "event=stopped reason=signal step=None" in events[-1]


@pytest.fixture
def restored_stop_handlers() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in early_stop.STOP_SIGNALS}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    early_stop.take()


def test_a_stop_held_since_the_process_started_is_the_lifecycles_first_signal(restored_stop_handlers, events):
    """`docker compose stop` in the seconds before the lifecycle's handlers exist: PID 1 would drop it, the process
    killed 90 s later. Held from the first instant, it stops the start before the first step."""
    early_stop.hold()
    os.kill(os.getpid(), signal.SIGTERM)
    life = _lifecycle()
    assert life.stops.reason is None
    life.stops.install_signal_handlers()
    assert life.stops.reason == lc.SIGNAL and "event=stop_requested signal=SIGTERM" in events[-1]
    assert early_stop.take() is None, "a held signal is taken once"


def test_a_second_stop_while_starting_exits_at_once(restored_stop_handlers, monkeypatch):
    exits: list[int] = []
    monkeypatch.setattr(early_stop.os, "_exit", exits.append)
    early_stop.hold()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert exits == [128 + signal.SIGINT] and early_stop.take() == signal.SIGTERM


def test_a_crash_exits_at_once_with_its_traceback(restored_stop_handlers, monkeypatch, capsys):
    """TRL's rollout child dead, the interpreter's shutdown would wait forever on a queue it no longer reads: the
    console script exits with EXIT_CRASH at once, so Docker's on-failure policy restarts the trainer."""
    from lorafleet_trainer import main as trainer_main

    def crash() -> int:
        raise RuntimeError("Rollout worker child has failed; see chained exception.")

    exits: list[int] = []
    monkeypatch.setattr(trainer_main, "main", crash)
    monkeypatch.setattr(trainer_main.os, "_exit", exits.append)
    trainer_main.entry()
    assert exits == [trainer_main.EXIT_CRASH] and trainer_main.EXIT_CRASH != 0
    assert "RuntimeError: Rollout worker child has failed" in capsys.readouterr().err


def test_reaching_max_steps_is_finished_not_stopped(tmp_path, events):
    from lorafleet_trainer.main import run_until_stopped

    life = _lifecycle()
    trainer = FakeTrainer(tmp_path, life, stop_at=-1)
    trainer.state.max_steps = 2
    assert run_until_stopped(trainer, life, None) == 0
    assert (tmp_path / "final-adapter").is_dir()
    assert "event=finished steps=2" in events[-1]


def test_each_step_end_prunes_published_versions_to_trls_window(tmp_path):
    """MAX_STALENESS + 2 versions, counted from the newest on disk: what a killed start left behind goes too."""
    from lorafleet.settings import TrainerSettings, load_settings

    limits = Limits.from_settings(load_settings(TrainerSettings, adapter_root=tmp_path, max_staleness=1))
    assert limits.keep_versions == 3
    lora = tmp_path / ".vllm_lora"
    for version in (2, 5, 6, 7):
        (lora / f"trl-policy-v{version}").mkdir(parents=True)
    life = RunLifecycle(StopDecision(limits, clock=Clock(), disk=lambda _: 10 * GB))
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    life.on_step_end(SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=1,
                                                                                is_world_process_zero=True), control)
    assert sorted(path.name for path in lora.iterdir()) == ["trl-policy-v5", "trl-policy-v6", "trl-policy-v7"]


def test_a_start_that_finds_the_run_at_max_steps_trains_nothing_and_exits_0(tmp_path, monkeypatch, capsys):
    """Killed after checkpoint-<MAX_STEPS> was complete but before it exited, then started again with the same
    settings: MAX_STEPS is the run's total across starts, so nothing is left to train. The fleet is never asked
    (its URL is a closed port), nothing is published, the final adapter is the checkpoint's."""
    import json

    import torch
    from lorafleet_trainer import main
    from safetensors.torch import save_file

    run = tmp_path / "runs" / "done"
    checkpoint = run / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "rollout_state.json").write_text(json.dumps({"prompt_index": 12, "model_version": 4}))
    (checkpoint / "adapter_config.json").write_text("{}")
    save_file({"lora_A.weight": torch.ones(1, 2)}, str(checkpoint / "adapter_model.safetensors"))
    env = {"ADAPTER_ROOT": str(tmp_path), "RUN_NAME": "done", "MAX_STEPS": "3", "TRAINER_TASK": "tiny",
           "TRAINER_MIN_FREE_GB": "0", "TRAINER_VLLM_URL": "http://127.0.0.1:9", "BASE_MODEL": str(tmp_path / "none")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")
    assert main.main([]) == 0
    finished = [line for line in capsys.readouterr().err.splitlines() if "event=finished" in line]
    assert len(finished) == 1 and "steps=3 model_version=4" in finished[0] and "already_complete=True" in finished[0]
    assert sorted(path.name for path in run.iterdir()) == ["checkpoint-3", "final-adapter"]  # no .vllm_lora
    assert (run / "final-adapter" / "adapter_model.safetensors").read_bytes() == (
        checkpoint / "adapter_model.safetensors").read_bytes()
