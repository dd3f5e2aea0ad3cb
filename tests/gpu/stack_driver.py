"""Drives the Compose stack for the stack test: what the host lacks, one Compose project, its teardown.

Every Compose call names its project, project directory and env file, so the stack reads only the env file
the test wrote (problem 5: a developer's `.env` is in the repository, not in the test's project directory)
and the caller's environment cannot override it (settings variables are removed from the subprocess).
A failed command raises with its stderr before any output is parsed (problem 6). `up` and `run` never
build or pull: the images must exist (`make test-gpu` / `make test-stack` build them first, visibly).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lorafleet.settings import Settings, env_name
from stack_plan import NotEnoughDevices, Profile, StackPlan, cpu_layout, gpu_layout, parse_gpu_indices

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess[str]]


class StackError(RuntimeError):
    """A docker / compose command failed; the message holds the command, its exit code and stderr."""


def run_command(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run with the stack's settings variables removed from the environment: only the env file decides.

    A time-out returns exit code 124 (like timeout(1)) so that callers report it like any failed command.
    """
    blocked = {env_name(name) for name in Settings.model_fields}
    env = {key: value for key, value in os.environ.items() if key not in blocked and not key.startswith("COMPOSE_")}
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as exc:  # a hung engine reads as a failed command, with what it printed
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(list(argv), 124, output, f"timed out after {timeout_s:.0f}s")


def checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if result.returncode != 0:
        command = " ".join(result.args) if isinstance(result.args, list) else str(result.args)
        output = "\n".join(part[-3000:] for part in (result.stdout, result.stderr) if part)
        raise StackError(f"`{command}` exited {result.returncode}:\n{output}")
    return result


def missing_requirements(profile: Profile, replicas: int, runner: Runner = run_command) -> str | None:
    """None when this host can run the stack test, else one line naming what is missing."""
    if shutil.which("docker") is None:
        return "stack test needs Docker: no `docker` CLI on PATH"
    info = runner(["docker", "info", "--format", "{{.ServerVersion}}"], 30)
    if info.returncode != 0 or not info.stdout.strip():
        return f"stack test needs a Docker engine: `docker info` failed ({_first_line(info.stderr)})"
    version = runner(["docker", "compose", "version", "--short"], 30)
    if version.returncode != 0:
        return ("stack test needs the Docker Compose v2 plugin: `docker compose version` failed "
                f"({_first_line(version.stderr)})")
    try:
        if profile == "gpu":
            if shutil.which("nvidia-smi") is None:
                return "stack test (gpu profile) needs NVIDIA GPUs: no `nvidia-smi` on PATH (CPU=1: the cpu profile)"
            gpu_layout(detect_gpus(runner), replicas)
        else:
            cpu_layout(os.cpu_count() or 1, replicas)
    except NotEnoughDevices as exc:
        return f"stack test ({profile} profile) {exc}"
    return None


def host_nvidia_smi(query: str, runner: Runner = run_command) -> str:
    """`nvidia-smi <query> --format=csv,noheader` on the Docker host."""
    return checked(runner(["nvidia-smi", query, "--format=csv,noheader"], 60)).stdout


def detect_gpus(runner: Runner = run_command) -> list[str]:
    """Host GPU indices as nvidia-smi numbers them (the numbering VLLM_GPUS and TRAINER_GPUS use)."""
    return sorted(parse_gpu_indices(host_nvidia_smi("--query-gpu=index,uuid", runner)).values(), key=int)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0][:200] if lines else "no output"


class Compose:
    """`docker compose` for one project: its own name, directory (holding the env file) and profile."""

    def __init__(self, plan: StackPlan, workdir: Path, runner: Runner = run_command) -> None:
        self.plan = plan
        self.workdir = workdir
        self.env_file = plan.write_env_file(workdir)
        self.runner = runner

    def argv(self, *args: str, project_directory: Path | None = None) -> list[str]:
        return ["docker", "compose", "--project-name", self.plan.project,
                "--project-directory", str(project_directory or self.workdir), "-f", str(COMPOSE_FILE),
                "--env-file", str(self.env_file), "--profile", self.plan.profile, *args]

    def run(self, *args: str, timeout_s: float = 600, check: bool = True,
            project_directory: Path | None = None) -> subprocess.CompletedProcess[str]:
        result = self.runner(self.argv(*args, project_directory=project_directory), timeout_s)
        return checked(result) if check else result

    def json(self, *args: str, timeout_s: float = 120) -> Any:
        """Output of a command as JSON, parsed only after its exit code was checked."""
        return json.loads(self.run(*args, timeout_s=timeout_s).stdout)

    def docker(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = self.runner(["docker", *args], timeout_s)
        return checked(result) if check else result

    # --- the life of the stack ---------------------------------------------------------------------------------
    def services(self) -> list[str]:
        """What the test starts: replicas and proxy (store-init comes as their dependency; the trainer on demand)."""
        return [self.plan.replica_service, "proxy"]

    def build(self, timeout_s: float = 3600) -> None:
        """Build the images of this profile from the repository (the only step that builds)."""
        self.run("build", *self.services(), self.plan.trainer_service, timeout_s=timeout_s, project_directory=REPO)

    def require_images(self) -> None:
        """Every image the profile uses exists locally; `run` would otherwise build the trainer image silently."""
        images = self.run("config", "--images", timeout_s=60).stdout.split()
        missing = [image for image in images if self.docker("image", "inspect", image, check=False).returncode != 0]
        if missing:
            raise StackError(f"images not built: {', '.join(missing)}; build them with `make test-stack"
                             f"{' CPU=1' if self.plan.profile == 'cpu' else ''}` (or `make test-gpu`)")

    def prepare(self) -> None:
        """cpu profile: build the offline tiny model into the adapters volume (replicas read it from there)."""
        if self.plan.profile == "cpu":
            self.run_trainer("--entrypoint", "lorafleet", args=["make-tiny-model", self.plan.base_model],
                             timeout_s=600)

    def up(self, replicas: int, wait_timeout_s: int) -> None:
        """Start (or scale) the fleet and wait until healthy; the proxy is healthy with one ready replica only."""
        self.run("up", "--detach", "--wait", "--wait-timeout", str(wait_timeout_s), "--no-build", "--pull", "never",
                 "--no-recreate", "--scale", f"{self.plan.replica_service}={replicas}", *self.services(),
                 timeout_s=wait_timeout_s + 120)

    def run_trainer(self, *options: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
                    timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
        """`compose run` of the trainer service: never builds or pulls, never starts dependencies."""
        settings = [f"--env={key}={value}" for key, value in (env or {}).items()]
        return self.run("run", "--rm", "--no-deps", "--pull", "never", "-T", *settings, *options,
                        self.plan.trainer_service, *args, timeout_s=timeout_s)

    def save_logs(self, artifacts: Path) -> Path:
        """`docker compose logs` of every container of the project, for the CI artifact."""
        artifacts.mkdir(parents=True, exist_ok=True)
        path = artifacts / f"{self.plan.project}.log"
        result = self.run("logs", "--no-color", "--timestamps", check=False, timeout_s=300)
        path.write_text(result.stdout + result.stderr)
        return path

    def save_container_log(self, container: str, artifacts: Path) -> Path:
        """`docker logs` of one container (a detached `compose run`, whose logs `compose logs` does not show)."""
        artifacts.mkdir(parents=True, exist_ok=True)
        path = artifacts / f"{container}.log"
        result = self.docker("logs", "--timestamps", container, check=False)
        path.write_text(result.stdout + result.stderr)
        return path

    def down(self) -> subprocess.CompletedProcess[str]:
        """Remove containers, networks and volumes: the next run starts from an empty store (problem 3)."""
        return self.run("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False, timeout_s=600)

    # --- looking inside ----------------------------------------------------------------------------------------
    def containers(self, service: str) -> list[dict[str, Any]]:
        """Running containers of a service (`ps --format json`: one object per line, or one list)."""
        out = self.run("ps", "--format", "json", service, timeout_s=60).stdout.strip()
        rows = json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines() if line]
        return sorted(rows, key=lambda row: row["Name"])

    def container_ip(self, container: str) -> str:
        """The container's address on the project's internal fleet network (the proxy's replica URL host)."""
        networks = json.loads(self.docker("inspect", "--format", "{{json .NetworkSettings.Networks}}",
                                          container).stdout)
        return networks[f"{self.plan.project}_fleet"]["IPAddress"]

    def read_file(self, service: str, path: str) -> str:
        return self.run("exec", "-T", service, "cat", path, timeout_s=60).stdout


class StackSession:
    """Bring the stack up for a test module and always take it down again, logs saved when anything failed."""

    def __init__(self, compose: Compose, artifacts: Path, *, build: bool, wait_timeout_s: int) -> None:
        self.compose = compose
        self.artifacts = artifacts
        self.build = build
        self.wait_timeout_s = wait_timeout_s

    def start(self) -> None:
        """Build (when asked), check images, prepare, `up --wait`; on any failure: logs, `down -v`, re-raise."""
        try:
            if self.build:
                self.compose.build()
            self.compose.require_images()
            self.compose.prepare()
            self.compose.up(self.compose.plan.replicas, self.wait_timeout_s)
        except BaseException:
            self.stop(failed=True)
            raise

    def stop(self, failed: bool) -> Path | None:
        logs = self.compose.save_logs(self.artifacts) if failed else None
        self.compose.down()
        return logs
