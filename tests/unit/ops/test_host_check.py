"""The host check (issue 44): `make up`, `make build`, `make test-gpu` and the GPU demo stop in seconds, naming what
is missing and CPU=1, before anything is pulled or built, on a host without an NVIDIA GPU or without Docker's nvidia
runtime. Driven with fake `nvidia-smi` and `docker` first on PATH (each logs its calls), through the module and
through make itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lorafleet_ops import host_check
from lorafleet_ops.host_check import EXIT_MISSING, Gpu, NoGpu, nvidia_gpus, parse_gpus

REPO = Path(__file__).resolve().parents[3]
H200_ROWS = "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
RUNTIMES = {"io.containerd.runc.v2": {"path": "runc"}, "runc": {"path": "runc"}}


def fake_tools(bin_dir: Path, *, gpus: str | None = H200_ROWS, runtimes: dict[str, object] | None = None,
               docker: bool = True) -> Path:
    """Fake `nvidia-smi` (prints `gpus`, or fails as a host without a driver does when None) and `docker` (`info`
    answers `runtimes`; `version` and `compose version` answer as Engine 27 / Compose 2.29; anything else is only
    logged). Returns the call log."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = bin_dir / "calls.log"
    smi = f"printf '%s' '{gpus}'" if gpus is not None else f'echo "{NO_DRIVER}"; exit 9'
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho \"nvidia-smi $*\" >> {calls}\n{smi}\n")
    if docker:
        answer = json.dumps(RUNTIMES if runtimes is None else runtimes)
        (bin_dir / "docker").write_text(
            f"#!/bin/sh\necho \"docker $*\" >> {calls}\n"
            f"case \"$1 $2\" in\n  'info --format') echo '{answer}';;\n  'version --format') echo 27.0.3;;\n"
            f"  'compose version') echo 2.29.1;;\nesac\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    calls.touch()
    return calls


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`on_path(**fakes)`: the fake tools first on PATH for this process; returns the call log."""

    def install(**fakes: object) -> Path:
        calls = fake_tools(tmp_path / "bin", **fakes)  # type: ignore[arg-type]
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        return calls

    return install


def test_parse_gpus_reads_index_name_and_memory() -> None:
    assert parse_gpus(H200_ROWS) == [Gpu(0, "NVIDIA H200", 143771), Gpu(1, "NVIDIA H200", 143771)]
    ada = "NVIDIA RTX 6000 Ada Generation"
    assert parse_gpus(f"3, {ada}, 49140\n\n") == [Gpu(3, ada, 49140)]


def test_the_gpus_nvidia_smi_lists(on_path) -> None:
    on_path()
    assert [gpu.index for gpu in nvidia_gpus()] == [0, 1]


def test_no_gpu_says_why(on_path) -> None:
    on_path(gpus=None)
    with pytest.raises(NoGpu, match="nvidia-smi failed \\(exit 9: NVIDIA-SMI has failed"):
        nvidia_gpus()
    on_path(gpus="")
    with pytest.raises(NoGpu, match="lists none"):
        nvidia_gpus()
    on_path(gpus="No devices were found")
    with pytest.raises(NoGpu, match="no GPU list \\(No devices were found\\)"):
        nvidia_gpus()


def test_no_nvidia_smi_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NoGpu, match="nvidia-smi is not on PATH"):
        nvidia_gpus()


def test_the_nvidia_runtime(on_path) -> None:
    on_path(runtimes={**RUNTIMES, "nvidia": {"path": "nvidia-container-runtime"}})
    assert host_check.docker_runtime_problem() is None
    on_path()
    problem = host_check.docker_runtime_problem()
    assert problem is not None and "no nvidia runtime (runtimes: io.containerd.runc.v2, runc)" in problem
    assert "nvidia-ctk runtime configure" in problem


def test_main_names_every_missing_part_and_cpu_1(on_path, capsys: pytest.CaptureFixture[str]) -> None:
    on_path(gpus=None)
    assert host_check.main(["--docker", "--for", "make up"]) == EXIT_MISSING
    message = capsys.readouterr().err
    assert message.startswith("make up stopped before pulling or building anything")
    assert "no NVIDIA GPU found" in message and "Docker has no nvidia runtime" in message and "CPU=1" in message
    assert message.count("\n") == 1, "one message, one line"
    on_path(runtimes={"nvidia": {}})
    assert host_check.main(["--docker"]) == 0
    assert host_check.main([]) == 0
    assert capsys.readouterr().err == ""


def make(target: str, bin_dir: Path, **variables: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """`make <target>` in the repository with the fakes first on PATH and the gpu profile (unless CPU=1)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MAKE", "MFLAGS"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", COMPOSE_PROFILES="gpu", PYTHON=sys.executable)
    began = time.monotonic()
    argv = ["make", "--no-print-directory", *target.split(), *(f"{key}={value}" for key, value in variables.items())]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - began


@pytest.mark.parametrize("target", ["up", "build", "test-gpu", "demo GPU=1"])
def test_make_stops_in_seconds_on_a_host_without_a_gpu_pulling_nothing(target: str, tmp_path: Path) -> None:
    calls = fake_tools(tmp_path / "bin", gpus=None)
    done, seconds = make(target, tmp_path / "bin")
    assert done.returncode != 0
    assert seconds < 10
    assert "stopped before pulling or building anything" in done.stderr and "CPU=1" in done.stderr, done.stderr
    assert "no NVIDIA GPU found" in done.stderr
    docker_calls = [line for line in calls.read_text().splitlines() if line.startswith("docker")]
    assert all(line.startswith("docker info") for line in docker_calls), docker_calls  # nothing pulled or built


def test_make_up_stops_on_a_gpu_host_without_the_nvidia_runtime(tmp_path: Path) -> None:
    calls = fake_tools(tmp_path / "bin")
    done, _ = make("up", tmp_path / "bin")
    assert done.returncode != 0 and "Docker has no nvidia runtime" in done.stderr and "CPU=1" in done.stderr
    assert "no NVIDIA GPU found" not in done.stderr
    assert "docker version" not in calls.read_text()


@pytest.mark.parametrize(("fakes", "variables"), [({"runtimes": {"nvidia": {}}}, {}), ({"gpus": None}, {"CPU": "1"})],
                         ids=["gpu host", "CPU=1"])
def test_make_up_goes_on_to_the_engine_check(fakes: dict[str, object], variables: dict[str, str],
                                             tmp_path: Path) -> None:
    """Past the host check: the engine check asks the (fake) docker its version; nothing real is built."""
    calls = fake_tools(tmp_path / "bin", **fakes)  # type: ignore[arg-type]
    done, _ = make("up", tmp_path / "bin", **variables)
    assert "stopped before pulling" not in done.stderr
    assert "docker version" in calls.read_text(), done.stderr
