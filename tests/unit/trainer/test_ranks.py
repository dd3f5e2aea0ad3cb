"""Several trainer ranks: the layout a configuration asks for, FSDP2/DDP wiring, and the launcher's supervision.

The launcher is exercised with real child processes (small Python programs standing in for ranks): exit codes,
a rank that dies while another waits forever (as in a collective), relayed signals, parent-death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from lorafleet.settings import ConfigError, StackSettings
from lorafleet_testing.pids import running
from lorafleet_trainer import early_stop
from lorafleet_trainer.config import build_configs, sharding_args
from lorafleet_trainer.main import resolve_settings
from lorafleet_trainer.ranks import (
    LAUNCHER_PID,
    Launcher,
    RankContext,
    RankPlan,
    exit_code,
    plan_for,
    plan_ranks,
    rank_env,
    select_gpus,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in StackSettings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ADAPTER_ROOT", str(tmp_path / "adapters"))


def settings(**values: str) -> StackSettings:
    return resolve_settings(values)


# --- the layout ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gpus", "visible", "ranks", "world"), [
    ("0", 1, "0", 1), ("0,1", 2, "0", 2), ("0,1", 8, "2", 2), ("2,3,4,5", 4, "0", 4),
])
def test_on_gpus_every_listed_gpu_is_a_rank_sharded_with_fsdp2(gpus, visible, ranks, world):
    plan = plan_ranks(settings(trainer_gpus=gpus, trainer_ranks=ranks), visible)
    assert (plan.world_size, plan.device) == (world, "cuda")
    assert plan.sharding == ("fsdp2" if world > 1 else "none")
    assert plan.backend == "nccl"


@pytest.mark.parametrize(("ranks", "world"), [("0", 1), ("1", 1), ("2", 2), ("3", 3)])
def test_on_cpu_trainer_ranks_sets_the_count(ranks, world):
    plan = plan_ranks(settings(trainer_ranks=ranks), 0)
    assert (plan.world_size, plan.device, plan.backend) == (world, "cpu", "gloo")
    assert plan.sharding == ("ddp" if world > 1 else "none")


def test_ddp_is_selectable_and_fsdp2_on_cpu_is_refused_not_replaced():
    assert plan_ranks(settings(trainer_gpus="0,1", trainer_sharding="ddp"), 2).sharding == "ddp"
    assert plan_ranks(settings(trainer_ranks="2", trainer_sharding="ddp"), 0).sharding == "ddp"
    assert plan_ranks(settings(trainer_sharding="ddp"), 1).sharding == "none"  # one rank shares nothing
    for ranks in ("1", "2"):
        with pytest.raises(ConfigError, match="TRAINER_SHARDING=fsdp2 cannot run on CPU"):
            plan_ranks(settings(trainer_ranks=ranks, trainer_sharding="fsdp2"), 0)


def test_one_gpu_runs_in_process_unless_fsdp2_is_asked_for():
    assert not plan_ranks(settings(), 1).launched
    one = plan_ranks(settings(trainer_sharding="fsdp2"), 1)
    assert (one.world_size, one.sharding, one.launched) == (1, "fsdp2", True)  # a launched FSDP2 rank of its own
    assert plan_for(settings(trainer_sharding="fsdp2"), RankContext.from_environ(rank_env({}, 0, 1, 1)), 1) == one


@pytest.mark.parametrize(("values", "visible", "message"), [
    ({"trainer_gpus": "0,1"}, 1, r"TRAINER_GPUS=0,1 lists 2 GPUs but the trainer sees 1"),
    ({"trainer_gpus": "0,1", "trainer_ranks": "3"}, 2, r"TRAINER_RANKS=3 but TRAINER_GPUS=0,1 lists 2"),
    ({"trainer_gpus": "0,1"}, 0, r"TRAINER_GPUS=0,1 lists 2 GPUs but torch sees no CUDA device.*TRAINER_RANKS=2"),
])
def test_a_layout_that_would_leave_devices_idle_is_refused_naming_the_settings(values, visible, message):
    with pytest.raises(ConfigError, match=message):
        plan_ranks(settings(**values), visible)


@pytest.mark.parametrize("value", ["0,0", "a", "", "0;1"])
def test_trainer_gpus_must_be_distinct_indices(value):
    with pytest.raises(ConfigError, match="TRAINER_GPUS"):
        settings(trainer_gpus=value)


def test_a_rank_takes_its_plan_from_the_launcher_environment():
    context = RankContext.from_environ(rank_env({}, rank=1, world_size=2, port=29500))
    assert (context.rank, context.local_rank, context.world_size, context.launcher_pid) == (1, 1, 2, os.getpid())
    plan = plan_for(settings(), context, 0)  # TRAINER_RANKS unset: the launcher's world size wins
    assert (plan.world_size, plan.sharding) == (2, "ddp")
    assert RankContext.from_environ({}) == RankContext()  # alone: rank 0 of 1, not launched
    assert not RankContext().launched
    torchrun = RankContext.from_environ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert torchrun.launched and torchrun.launcher_pid is None  # a launched rank, even alone, never launches again


def test_trainer_gpus_become_the_visible_gpus_unless_already_chosen():
    environ: dict[str, str] = {}
    select_gpus(settings(trainer_gpus="2,3"), environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    chosen = {"CUDA_VISIBLE_DEVICES": "GPU-abc"}  # Compose (or a scheduler) already picked them
    select_gpus(settings(trainer_gpus="2,3"), chosen)
    assert chosen == {"CUDA_VISIBLE_DEVICES": "GPU-abc"}


# --- FSDP2 / DDP wiring into TRL's config -------------------------------------------------------------------------


def test_fsdp2_uses_a_sharded_state_dict_and_reaches_accelerate():
    args = sharding_args(RankPlan(2, "cuda", "fsdp2"))
    assert args["fsdp_config"]["version"] == 2
    assert args["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT"
    # fp32: bf16 (the GPU default) is refused by transformers on this CPU-only box
    built = build_configs(settings(trainer_precision="fp32"), replicas=1, ranks=RankPlan(2, "cuda", "fsdp2"))
    plugin = built.grpo.fsdp_plugin_args  # what transformers hands accelerate's FullyShardedDataParallelPlugin
    assert plugin["fsdp_version"] == 2 and plugin["state_dict_type"] == "SHARDED_STATE_DICT"
    assert plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


def test_ddp_and_one_rank_need_no_fsdp():
    ddp = build_configs(settings(), replicas=1, ranks=RankPlan(2, "cpu", "ddp")).grpo
    assert not ddp.fsdp and ddp.ddp_find_unused_parameters is False
    assert sharding_args(RankPlan(1, "cuda", "none")) == {}


def test_effective_config_states_world_size_sharding_and_global_micro_batch():
    summary = build_configs(settings(token_budget="4096", trainer_precision="fp32"), replicas=2,
                            ranks=RankPlan(2, "cuda", "fsdp2")).summary()
    assert (summary["world_size"], summary["sharding"], summary["backend"]) == (2, "fsdp2", "nccl")
    assert (summary["tokens_per_microbatch_per_rank"], summary["tokens_per_microbatch"]) == (4096, 8192)
    fixed = build_configs(settings(token_budget="0", train_batch_size="3"), replicas=1,
                          ranks=RankPlan(3, "cpu", "ddp")).summary()
    assert fixed["samples_per_microbatch"] == 9 and fixed["tokens_per_microbatch"] is None


# --- the launcher, with real processes standing in for ranks --------------------------------------------------------

RANK_PROGRAM = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
out = os.environ["OUT"]
behaviour = os.environ["BEHAVIOUR_" + str(rank)]
def on_signal(signum, frame):
    with open(f"{out}/rank{rank}.signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if behaviour == "stop-on-signal":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_signal)
with open(f"{out}/rank{rank}.started", "w") as f:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LORAFLEET_LAUNCHER_PID")
    f.write(" ".join(os.environ[key] for key in keys) + " " + " ".join(sys.argv[1:]))
if behaviour.startswith("exit-"):
    time.sleep(0.3)
    sys.exit(int(behaviour.split("-")[1]))
while True:  # "hang" and "stop-on-signal": wait, as in a collective
    time.sleep(0.05)
"""


def stand_in(out: Path, behaviours: list[str], program: str = RANK_PROGRAM):
    """A `spawn` that starts `program` with the launcher's rank environment instead of the trainer."""

    def spawn(argv: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[bytes]:
        assert argv[1:3] == ["-m", "lorafleet_trainer.main"]
        extra = {"OUT": str(out), **{f"BEHAVIOUR_{i}": b for i, b in enumerate(behaviours)}}
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(program), *argv[3:]],
                                env={**env, **extra}, **kwargs)

    return spawn


def launcher(tmp_path: Path, behaviours: list[str], program: str = RANK_PROGRAM) -> Launcher:
    plan = RankPlan(len(behaviours), "cpu", "fsdp2")
    return Launcher(plan, ["--max-steps", "3"], environ=dict(os.environ), poll_s=0.05,
                    spawn=stand_in(tmp_path, behaviours, program))


def wait_started(tmp_path: Path, ranks: int) -> None:
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("rank*.started"))) < ranks:
        assert time.monotonic() < deadline, "the stand-in ranks did not start"
        time.sleep(0.02)


def test_ranks_get_distinct_ranks_one_rendezvous_and_the_same_flags(tmp_path):
    run = launcher(tmp_path, ["exit-0", "exit-0"])
    run.start()
    assert run.supervise() == 0
    seen = [(tmp_path / f"rank{i}.started").read_text().split() for i in range(2)]
    port = seen[0][4]
    assert seen == [[str(i), str(i), "2", "127.0.0.1", port, str(os.getpid()), "--max-steps", "3"] for i in range(2)]


def test_a_dead_rank_stops_the_run_at_once_with_its_exit_code(tmp_path, caplog):
    run = launcher(tmp_path, ["hang", "exit-7"])  # rank 0 would wait forever in a collective with rank 1
    started = time.monotonic()
    run.start()
    code = run.supervise()
    assert code == 7 and time.monotonic() - started < 15
    assert run.ranks[0].returncode == -signal.SIGKILL  # the survivor was killed, not left hanging
    assert any("rank_failed" in record.getMessage() and record.fields["rank"] == 1  # type: ignore[attr-defined]
               for record in caplog.records)


def test_a_rank_killed_by_a_signal_reports_128_plus_the_signal():
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(3) == 3 and exit_code(0) == 0


def test_stop_signals_reach_every_rank_once_per_signal(tmp_path):
    run = launcher(tmp_path, ["stop-on-signal", "stop-on-signal"])
    run.start()
    wait_started(tmp_path, 2)
    run.relay(signal.SIGTERM)
    assert run.supervise() == 0
    assert [(tmp_path / f"rank{i}.signals").read_text() for i in range(2)] == ["SIGTERM\n"] * 2


def test_the_ranks_do_not_see_a_signal_sent_to_the_launchers_process_group(tmp_path):
    """Each rank has a session of its own: only the launcher's relay reaches it (a second copy would force it)."""
    run = launcher(tmp_path, ["hang", "hang"])
    run.start()
    wait_started(tmp_path, 2)
    assert all(os.getpgid(rank.pid) != os.getpgid(0) for rank in run.ranks)
    run.stop_survivors()


PARENT_PROGRAM = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, time
from lorafleet_trainer.ranks import die_with_parent
die_with_parent(int(os.environ["{launcher}"]))
open("{ready}", "w").close()
time.sleep(60)
'''], env={{**os.environ, "{launcher}": str(os.getpid()), "PYTHONPATH": {path!r}}})
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_rank_dies_with_its_launcher(tmp_path):
    """SIGKILL the launcher: the kernel kills its rank too (PR_SET_PDEATHSIG), nothing is left training."""
    ready = tmp_path / "ready"
    program = PARENT_PROGRAM.format(path=os.pathsep.join(sys.path), launcher=LAUNCHER_PID, ready=ready)
    parent = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while running(child):
        assert time.monotonic() < deadline, "the rank outlived its launcher"
        time.sleep(0.05)


def test_a_stop_held_while_the_launcher_started_starts_no_rank(tmp_path):
    run = launcher(tmp_path, ["stop-on-signal", "stop-on-signal"])
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        early_stop.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.run() == 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert run.ranks == [] and not list(tmp_path.glob("rank*.signals"))


def test_run_relays_a_real_signal_to_every_rank(tmp_path):
    """Launcher.run installs the relay: a real SIGTERM to this process reaches both ranks."""
    run = launcher(tmp_path, ["stop-on-signal", "stop-on-signal"])
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        def send_when_started() -> None:
            wait_started(tmp_path, 2)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=send_when_started, daemon=True).start()
        assert run.run() == 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert all((tmp_path / f"rank{i}.signals").read_text() == "SIGTERM\n" for i in range(2))


GLOO_RANK_PROGRAM = """
import os, sys
import torch, torch.distributed as dist
from lorafleet_trainer import main as trainer_main

def train(*args, **kwargs):  # the trainer's collectives, as its last adapter gather does, then a normal return
    dist.init_process_group("gloo")
    tensor = torch.ones(1000)
    for _ in range(20):
        dist.all_reduce(tensor)
        dist.all_gather([torch.empty(1000) for _ in range(dist.get_world_size())], tensor)
    return 0

trainer_main.train = train
code = trainer_main.main(sys.argv[1:])
with open(os.environ["OUT"] + "/rank" + os.environ["RANK"] + ".after", "w") as f:
    f.write(str(dist.is_initialized()))
sys.exit(code)
"""


def test_a_rank_that_trained_leaves_its_process_group_and_exits_0(tmp_path, monkeypatch):
    """Three real gloo ranks through the real `main`: each leaves its group before the interpreter's shutdown,
    where gloo aborts a process that still holds one (SIGABRT, exit 134: a finished run read as a failed rank)."""
    for key, value in {"ADAPTER_ROOT": str(tmp_path), "TRAINER_REPLICAS": "1", "LORAFLEET_ENV_FILE": "",
                       "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    run = launcher(tmp_path, ["gloo"] * 3, GLOO_RANK_PROGRAM)
    run.start()
    assert run.supervise() == 0, [rank.returncode for rank in run.ranks]
    assert [(tmp_path / f"rank{i}.after").read_text() for i in range(3)] == ["False"] * 3
