"""GPU placement in process mode (issue 44) against faked devices: one replica per GPU or several sharing one with
their memory fractions, the trainer on its own GPU or sharing one; the replicas' own claims (real lock files) put
them where the plan says, and bad input is refused naming the setting or option."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.gpu_sharing import MEMORY_BUDGET, gpu_shares
from lorafleet.settings import load_settings
from lorafleet_ops import processes
from lorafleet_ops.commands import demo
from lorafleet_ops.commands.cli import main as cli_main
from lorafleet_ops.host_check import Gpu, NoGpu
from lorafleet_ops.placement import (
    FRACTION_VARIABLE,
    SETTING_FRACTION,
    PlacementError,
    detect_gpus,
    parse_gpu_list,
    plan,
)
from lorafleet_vllm.claim import NoFreeDevice, claim_device
from lorafleet_vllm.main import claim_for


def h200s(count: int) -> list[Gpu]:
    return [Gpu(index, "NVIDIA H200", 143771) for index in range(count)]


def claims(pool: tuple[int, ...], fraction: float, replicas: int) -> Counter[str]:
    """Where `replicas` replicas land by their own claims (real lock files) on `pool` at `fraction` each."""
    held: list[int] = []
    with tempfile.TemporaryDirectory() as lock_dir:
        try:
            for _ in range(replicas):
                held.append(claim_device([str(gpu) for gpu in pool], Path(lock_dir), kind="gpu",
                                         pool_variable="VLLM_GPUS", shares=gpu_shares(fraction)).fd)
            counts: Counter[str] = Counter(path.name.split(".")[0] for path in Path(lock_dir).iterdir())
        finally:
            for fd in held:
                os.close(fd)
    return counts


def test_one_gpu_workstation_three_replicas_and_the_trainer_share_it() -> None:
    placement = plan([0], 3)
    assert placement.trainer_gpu == 0 and placement.trainer_shares
    assert placement.replica_gpus == (0,) and placement.per_gpu == 3
    assert placement.memory_fraction == 0.233  # (0.95 - the trainer's 0.25) / 3, rounded down
    assert placement.wave == 1, "replicas sharing a GPU start one at a time"
    assert placement.replica_env() == {"REPLICA_DEVICE": "gpu", "VLLM_GPUS": "0", FRACTION_VARIABLE: "0.233"}
    assert placement.trainer_env() == {"TRAINER_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}
    assert claims(placement.replica_gpus, placement.memory_fraction, 3) == {"gpu-0": 3}


def test_eight_gpus_one_replica_each_and_the_trainer_on_its_own() -> None:
    placement = plan(list(range(8)), 3)
    assert placement.trainer_gpu == 0 and not placement.trainer_shares
    assert placement.replica_gpus == (1, 2, 3, 4, 5, 6, 7) and placement.per_gpu == 1
    assert placement.memory_fraction == SETTING_FRACTION  # the setting's default where a replica has a GPU alone
    assert placement.wave == 3, "replicas on GPUs of their own start together"
    assert claims(placement.replica_gpus, placement.memory_fraction, 3) == {"gpu-1": 1, "gpu-2": 1, "gpu-3": 1}


def test_the_trainer_on_its_own_gpu_and_four_replicas_sharing_the_other() -> None:
    placement = plan([0, 1], 4, trainer="own")
    assert placement.replica_gpus == (1,) and placement.per_gpu == 4
    assert placement.memory_fraction == 0.237
    assert claims(placement.replica_gpus, placement.memory_fraction, 4) == {"gpu-1": 4}


def test_the_trainer_shares_on_request_with_several_gpus() -> None:
    placement = plan([2, 3], 4, trainer="shared")
    assert placement.trainer_gpu == 2 and placement.replica_gpus == (2, 3) and placement.per_gpu == 2
    assert placement.memory_fraction == 0.35  # GPU 2 holds the trainer's reserve and two replicas
    assert placement.wave == 2
    assert claims(placement.replica_gpus, placement.memory_fraction, 4) == {"gpu-2": 2, "gpu-3": 2}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: plan([0], 2, fraction=0.5), f"{FRACTION_VARIABLE}=0.5 does not fit: 2 replicas on GPU 0 take 1.000 "
                                         "of its memory plus the trainer's reserve 0.25, above 0.95; set "
                                         f"{FRACTION_VARIABLE} to at most 0.35"),
    (lambda: plan([0, 1], 2, trainer="own", fraction=0.5), "2 replicas on GPU 1 take 1.000 of its memory, above"),
    (lambda: plan([0], 1, trainer="own"), "the trainer on a GPU of its own needs 2 GPUs, 1 given"),
    (lambda: plan([], 1), "no GPU to place replicas on"),
    (lambda: plan([0, 0], 1), "names a GPU twice"),
    (lambda: plan([0], 0), "replicas must be at least 1"),
    (lambda: plan([0], 1, fraction=1.5), f"{FRACTION_VARIABLE} must be in \\(0, 1\\]"),
    (lambda: plan([0], 1, trainer="beside"), "trainer placement must be one of auto, own, shared"),  # type: ignore[arg-type]
    (lambda: plan([0], 100), "100 replicas per GPU leave each less than 1% of its memory"),
])
def test_what_does_not_fit_is_refused_naming_the_setting(call, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        call()


@given(gpus=st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True), replicas=st.integers(1, 24),
       trainer=st.sampled_from(["auto", "own", "shared"]), reserve=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
       fraction=st.one_of(st.none(), st.floats(0.01, 1.0)))
def test_a_plan_fits_every_gpu_and_the_claims_follow_it(gpus: list[int], replicas: int, trainer: str, reserve: float,
                                                         fraction: float | None) -> None:
    """Whatever is asked: refused, or every replica claims a GPU of the pool and no GPU is filled past the budget
    (its replicas' fractions, plus the trainer's reserve where the trainer shares it)."""
    try:
        placement = plan(gpus, replicas, trainer, fraction, reserve)  # type: ignore[arg-type]
    except PlacementError:
        return
    own = not placement.trainer_shares
    assert (trainer == "own" or (trainer == "auto" and len(gpus) > 1)) == own
    assert placement.trainer_gpu == gpus[0] and (placement.trainer_gpu in placement.replica_gpus) != own
    assert gpu_shares(placement.memory_fraction) >= placement.per_gpu, "a replica would find no free claim"
    landed = claims(placement.replica_gpus, placement.memory_fraction, replicas)
    assert sum(landed.values()) == replicas and max(landed.values()) == placement.per_gpu
    for lock, count in landed.items():
        trainer_share = reserve if int(lock.removeprefix("gpu-")) == placement.trainer_gpu else 0.0
        assert count * placement.memory_fraction + trainer_share <= MEMORY_BUDGET + 1e-9, (lock, count, placement)


@given(fraction=st.floats(0.01, 1.0))
def test_gpu_shares_is_the_most_replicas_that_fit(fraction: float) -> None:
    shares = gpu_shares(fraction)
    assert shares == 1 or shares * fraction <= MEMORY_BUDGET + 1e-9
    assert (shares + 1) * fraction > MEMORY_BUDGET - 1e-9


def test_the_replica_claims_as_many_shares_of_a_gpu_as_its_fraction_allows(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """lorafleet-replica's own claim: three replicas at 0.3 share GPU 0, a fourth is refused; at the default 0.85
    a GPU stays one replica's (as in the Compose stack)."""
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")
    shared = load_settings(replica_device="gpu", vllm_gpus="0", vllm_gpu_memory_utilization=0.3,
                           adapter_root=str(tmp_path / "a"))
    held = [claim_for(shared) for _ in range(3)]
    assert {claim.device for claim in held} == {"0"}
    with pytest.raises(NoFreeDevice, match="each shared by up to 3 replicas"):
        claim_for(shared)
    alone = load_settings(replica_device="gpu", vllm_gpus="0", adapter_root=str(tmp_path / "b"))
    held.append(claim_for(alone))
    with pytest.raises(NoFreeDevice, match="VLLM_GPUS has 1 device"):
        claim_for(alone)
    for claim in held:
        os.close(claim.fd)


# --- the devices: nvidia-smi's list, a choice, CUDA_VISIBLE_DEVICES ---------------------------------------------
def test_detect_gpus_every_listed_gpu_or_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert detect_gpus(query=lambda: h200s(4)) == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert detect_gpus(query=lambda: h200s(4)) == [1]
    assert detect_gpus(query=lambda: h200s(4), visible="2,3,9") == [2, 3]
    assert detect_gpus(query=lambda: h200s(4), visible="") == []
    assert detect_gpus([3, 1], query=lambda: h200s(4), visible="0") == [3, 1], "a choice wins over the environment"


def test_detect_gpus_refuses_what_it_cannot_place() -> None:
    listed = "--gpus names GPU\\(s\\) 5 that nvidia-smi does not list \\(it lists 0,1\\)"
    with pytest.raises(PlacementError, match=listed):
        detect_gpus([1, 5], query=lambda: h200s(2))
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES=GPU-8f2c does not name GPUs by index"):
        detect_gpus(query=lambda: h200s(2), visible="GPU-8f2c")

    def no_gpu() -> list[Gpu]:
        raise NoGpu("no NVIDIA GPU found: nvidia-smi is not on PATH")

    with pytest.raises(PlacementError, match="nvidia-smi is not on PATH"):
        detect_gpus(query=no_gpu)


@pytest.mark.parametrize("text", ["", "0,,a", "-1", "0;1"])
def test_gpu_lists_are_indices(text: str) -> None:
    with pytest.raises(PlacementError, match="LORAFLEET_TEST_GPUS must be GPU indices"):
        parse_gpu_list(text, "LORAFLEET_TEST_GPUS")
    assert parse_gpu_list(" 0, 2 ", "x") == [0, 2]


# --- its users: the demo's switch, the waves replicas start in ---------------------------------------------------
def test_the_demo_on_gpus_gets_the_placement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo, "detect_gpus", lambda requested: list(requested or (0,)))
    replica, trainer, placement = demo.device_settings(demo.DemoOptions(out=tmp_path, device="gpu", gpus=(4, 5)))
    assert placement is not None and placement.trainer_gpu == 4 and placement.replica_gpus == (5,)
    assert replica == {"REPLICA_DEVICE": "gpu", "VLLM_GPUS": "5", FRACTION_VARIABLE: "0.475", "VLLM_DTYPE": "bfloat16"}
    assert trainer == {"TRAINER_GPUS": "4", "CUDA_VISIBLE_DEVICES": "4"}
    replica, trainer, placement = demo.device_settings(demo.DemoOptions(out=tmp_path))
    assert placement is None and trainer == {} and replica["REPLICA_DEVICE"] == "cpu"


def test_the_demo_on_a_host_without_a_gpu_stops_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(demo, "replica_service", lambda *args, **kwargs: pytest.fail("a replica was started"))
    assert cli_main(["demo", "--device", "gpu", "--out", str(tmp_path / "out")]) == 2
    assert "no NVIDIA GPU found: nvidia-smi is not on PATH" in capsys.readouterr().err
    assert cli_main(["demo", "--device", "gpu", "--gpus", "zero", "--out", str(tmp_path / "out")]) == 2
    assert "--gpus must be GPU indices" in capsys.readouterr().err


def test_replicas_start_in_waves_each_healthy_before_the_next(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    events: list[str] = []
    monkeypatch.setattr(processes.Service, "start", lambda self: events.append(f"start {self.name}") or self)
    monkeypatch.setattr(processes, "wait_healthy",
                        lambda batch, timeout_s: events.append("healthy " + ",".join(s.name for s in batch)))
    services = [processes.Service(f"r{i}", ["true"], {}, tmp_path / f"r{i}.log") for i in range(5)]
    processes.start_in_waves(services, 2)
    assert events == ["start r0", "start r1", "healthy r0,r1", "start r2", "start r3", "healthy r2,r3", "start r4",
                      "healthy r4"]
    events.clear()
    processes.start_in_waves(services, plan([0], 5, fraction=0.1).wave)  # five sharing one GPU: one at a time
    assert events == [event for i in range(5) for event in (f"start r{i}", f"healthy r{i}")]
