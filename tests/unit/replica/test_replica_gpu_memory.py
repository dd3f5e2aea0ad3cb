"""The replica's own check of its GPU's free memory before vLLM starts (lorafleet_vllm.gpu_memory): a replica that
cannot fit stops at once, naming VLLM_GPU_MEMORY_UTILIZATION and the free memory it saw, and starts nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from lorafleet_vllm import gpu_memory, main
from lorafleet_vllm.gpu_memory import GpuMemory, NotEnoughGpuMemory, check_room

pytestmark = pytest.mark.timeout(60)
H100_MIB = 81559

# What bench-gpu's replica-2 saw on the H100 (2026-12-07): 32.21 GiB free when it asked for 0.475.
AFTER_FIRST = [GpuMemory(0, int(32.21 * 1024), H100_MIB), GpuMemory(1, H100_MIB - 500, H100_MIB)]


def test_a_replica_that_cannot_fit_is_refused_naming_the_setting_and_the_free_memory() -> None:
    with pytest.raises(NotEnoughGpuMemory) as caught:
        check_room("0", 0.475, lambda: AFTER_FIRST)
    message = str(caught.value)
    assert "VLLM_GPU_MEMORY_UTILIZATION=0.475" in message and "32.21 GiB free of 79.65 GiB" in message
    assert "at most 0.404" in message  # what is free now, as a fraction, rounded down


def test_a_replica_that_fits_gets_what_it_saw_and_the_right_gpu_is_read() -> None:
    assert check_room("1", 0.475, lambda: AFTER_FIRST).index == 1
    assert check_room(None, 0.3, lambda: AFTER_FIRST).index == 0  # scheduler mode: the GPU the runtime shows first
    with pytest.raises(NotEnoughGpuMemory, match="lists no GPU 7"):
        check_room("7", 0.3, lambda: AFTER_FIRST)


def test_nvidia_smi_output_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert argv == gpu_memory.QUERY
        return subprocess.CompletedProcess(argv, 0, "0, 32983, 81559\n1, 81000, 81559\n", "")

    monkeypatch.setattr(gpu_memory.subprocess, "run", run)
    assert gpu_memory.query_nvidia_smi() == [GpuMemory(0, 32983, 81559), GpuMemory(1, 81000, 81559)]


def test_the_replica_stops_before_vllm_when_its_gpu_is_too_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in {"LORAFLEET_ENV_FILE": "", "REPLICA_DEVICE": "gpu", "VLLM_GPUS": "0",
                       "VLLM_GPU_MEMORY_UTILIZATION": "0.475", "ADAPTER_ROOT": str(tmp_path / "adapters")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(main, "check_room", lambda device, fraction: check_room(device, fraction, lambda: AFTER_FIRST))

    def never(*_: object) -> None:
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(main.os, "execve", never)
    assert main.main([]) == main.EXIT_NO_GPU_MEMORY
    assert "VLLM_GPU_MEMORY_UTILIZATION=0.475" in capsys.readouterr().err
