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
    place,
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
    # (1 - the trainer's 0.25 - (the driver's 1 GiB + 3 engines' 2 GiB) / 79.65 GiB) / 3, rounded down
    assert placement.memory_fraction == 0.22
    assert placement.wave == 1, "replicas sharing a GPU start one at a time"
    assert placement.replica_env() == {"REPLICA_DEVICE": "gpu", "VLLM_GPUS": "0", FRACTION_VARIABLE: "0.22"}
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
    assert placement.memory_fraction == 0.221
    assert claims(placement.replica_gpus, placement.memory_fraction, 4) == {"gpu-1": 4}


def test_the_trainer_shares_on_request_with_several_gpus() -> None:
    placement = plan([2, 3], 4, trainer="shared")
    assert placement.trainer_gpu == 2 and placement.replica_gpus == (2, 3) and placement.per_gpu == 2
    assert placement.memory_fraction == 0.343  # GPU 2 holds the trainer's reserve and two replicas
    assert placement.wave == 2
    assert claims(placement.replica_gpus, placement.memory_fraction, 4) == {"gpu-2": 2, "gpu-3": 2}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: plan([0], 2, fraction=0.5), f"{FRACTION_VARIABLE}=0.5 does not fit: 2 replica\\(s\\) on GPU 0 \\(79.6 "
                                         "GiB\\) beside the trainer's reserve 0.25 cannot each find 0.5 of it free "
                                         f"when they start, .*; set {FRACTION_VARIABLE} to at most 0.343"),
    (lambda: plan([0, 1], 2, trainer="own", fraction=0.5), "2 replica\\(s\\) on GPU 1 .* at most 0.468"),
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
    smi_gib, cuda_total, fresh_free = CARDS["H100 80GB"]  # plan's reference card
    for lock, count in landed.items():
        trainer_gib = reserve * smi_gib if int(lock.removeprefix("gpu-")) == placement.trainer_gpu else 0.0
        assert vllm_starts(smi_gib, cuda_total, fresh_free, placement.memory_fraction, count, trainer_gib) == [], (
            lock, count, placement)


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
    host = [Gpu(index, "NVIDIA H100 80GB HBM3", 81559) for index in range(8)]
    monkeypatch.setattr(demo, "place", lambda *args, **kwargs: place(*args, **kwargs, query=lambda: host))
    replica, trainer, placement = demo.device_settings(demo.DemoOptions(out=tmp_path, device="gpu", gpus=(4, 5)))
    assert placement is not None and placement.trainer_gpu == 4 and placement.replica_gpus == (5,)
    assert replica == {"REPLICA_DEVICE": "gpu", "VLLM_GPUS": "5", FRACTION_VARIABLE: "0.468", "VLLM_DTYPE": "bfloat16"}
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


# --- the fraction against vLLM's own start-up rule, on the cards the GPU tier runs on -------------------------------
# nvidia-smi's total, what CUDA reports as the card's total and as free on a fresh card, and what one started engine
# holds beyond its fraction, as measured: H100 80GB HBM3 on 2026-12-07 (bench-gpu: 79.18 GiB total, 78.66 free, an
# engine asked for 37.61 GiB took 39.08); H200 143771 MiB, scaled alike (its CUDA total ~0.47 GiB under nvidia-smi's).
CARDS = {"H100 80GB": (81559 / 1024, 79.18, 78.66), "H200 141GB": (143771 / 1024, 139.93, 139.41)}
ENGINE_EXTRA_GIB = 1.47


def vllm_starts(smi_gib: float, cuda_total: float, fresh_free: float, fraction: float, replicas: int,
                trainer_gib: float) -> list[str]:
    """vLLM's rule replayed: the trainer first (it may start before the replicas), then each replica finds at least
    `fraction` of CUDA's total free and then holds it plus its engine's extra. Returns what fails."""
    free = fresh_free - trainer_gib
    problems = []
    for number in range(1, replicas + 1):
        asked = fraction * cuda_total
        if free < asked:
            problems.append(f"replica {number}: {free:.2f} GiB free < {asked:.2f} asked")
        free -= asked + ENGINE_EXTRA_GIB
    if free < 0:
        problems.append(f"the card is over-committed by {-free:.2f} GiB once all started")
    return problems


@pytest.mark.parametrize("card", sorted(CARDS))
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("trainer", ["shared", "own"])
def test_every_placed_replica_passes_vllms_start_up_rule_on_the_real_cards(card: str, replicas: int,
                                                                         trainer: str) -> None:
    smi_gib, cuda_total, fresh_free = CARDS[card]
    gpus = [0] if trainer == "shared" else [0, 1]
    placement = plan(gpus, replicas, trainer, card_gib=smi_gib)  # type: ignore[arg-type]
    trainer_gib = 0.25 * smi_gib if placement.trainer_shares else 0.0
    assert vllm_starts(smi_gib, cuda_total, fresh_free, placement.memory_fraction, placement.per_gpu,
                       trainer_gib) == []
    assert placement.memory_fraction >= 0.15, "a replica keeps room for a 1.5B model's weights and a KV cache"


def test_the_fractions_the_h100_refused_would_be_refused_here() -> None:
    """bench-gpu's two replicas at 0.475 beside a process holding 7.9 GiB: vLLM refused the second on the H100, and
    the replay refuses it too; the placement for two replicas alone asks less, and passes."""
    smi_gib, cuda_total, fresh_free = CARDS["H100 80GB"]
    assert vllm_starts(smi_gib, cuda_total, fresh_free, 0.475, 2, 7.9)
    placement = plan([0], 2, "shared", trainer_reserve=0.0, card_gib=smi_gib)
    assert placement.memory_fraction == 0.468
    assert vllm_starts(smi_gib, cuda_total, fresh_free, placement.memory_fraction, 2, 0.0) == []


def test_placement_reads_the_cards_size_from_nvidia_smi() -> None:
    placement = place(None, 2, "shared", trainer_reserve=0.0, query=lambda: h200s(1))
    assert placement.memory_fraction == 0.482  # more of an H200 is left once the fixed overheads are paid
    with pytest.raises(PlacementError, match="names GPU"):
        place([3], 1, query=lambda: h200s(1))
