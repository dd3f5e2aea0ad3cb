"""Drives the Compose stack for the stack test the way a user does: a fresh copy of the project, `.env` made from
`.env.example`, and docs/guides/gpu-stack.md's own commands (`make up`, `make status`, `make doctor`, `make scale`,
`make down`).

The copy is the project directory, so relative build contexts and bind mounts resolve inside it, and a developer's
`.env` in the repository is never read. Every command runs with the stack's settings variables and COMPOSE_*
removed from the environment, so only the copy's `.env` decides. A failed command raises with its output before
anything is parsed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lorafleet.settings import StackSettings, env_name

from lorafleet_testing import REPO
from lorafleet_testing.stack_plan import NotEnoughDevices, Profile, StackPlan, cpu_layout, gpu_layout, parse_gpu_indices

Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess[str]]


class StackError(RuntimeError):
    """A docker / compose / make command failed; the message holds the command, its exit code and output."""


def run_command(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run with the stack's settings variables removed from the environment: only the project's `.env` decides.

    A time-out returns exit code 124 (like timeout(1)) so that callers report it like any failed command.
    """
    blocked = {env_name(name) for name in StackSettings.model_fields}
    env = {key: value for key, value in os.environ.items()
           if key not in blocked and not key.startswith("COMPOSE_") and key not in ("CPU", "MAKEFLAGS", "MAKELEVEL")}
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as exc:  # a hung engine reads as a failed command, with what it printed
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(list(argv), 124, output, f"timed out after {timeout_s:.0f}s")


def checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if result.returncode != 0:
        command = " ".join(result.args) if isinstance(result.args, list) else str(result.args)
        output = "\n".join(part[-4000:] for part in (result.stdout, result.stderr) if part)
        raise StackError(f"`{command}` exited {result.returncode}:\n{output}")
    return result


def missing_requirements(profile: Profile, replicas: int, runner: Runner = run_command) -> str | None:
    """None when this host can run the stack test, else one line naming what is missing."""
    if shutil.which("docker") is None:
        return "stack test needs Docker: no `docker` CLI on PATH (start one: eval \"$(tools/engine.sh start)\")"
    check = runner(["bash", str(REPO / "tools" / "engine.sh"), "check"], 60)
    if check.returncode != 0:
        return f"stack test: {_first_line(check.stdout + check.stderr)}"
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
    return lines[0][:300] if lines else "no output"


def copy_project(destination: Path, repo: Path = REPO) -> Path:
    """The project as a fresh clone has it: tracked and untracked-not-ignored files (no .venv, .env, results)."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = repo / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


class Stack:
    """One Compose project in a copy of the repository: the user's make targets, and docker to look inside."""

    def __init__(self, plan: StackPlan, directory: Path, runner: Runner = run_command) -> None:
        self.plan = plan
        self.directory = directory
        self.env_file = plan.write_env_file(directory)
        self.runner = runner

    # --- what the user types ---------------------------------------------------------------------------------
    def make(self, *targets: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`make <targets>` in the project, with CPU=1 on the cpu profile (docs/guides/cpu-mode.md: `make up CPU=1`)."""
        variables = ["CPU=1"] if self.plan.profile == "cpu" else []
        result = self.runner(["make", "--no-print-directory", "-C", str(self.directory), *targets, *variables],
                             timeout_s)
        return checked(result) if check else result

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`docker compose <args>` in the project directory with the profile's services visible."""
        argv = ["docker", "compose", "--project-directory", str(self.directory), "--profile", self.plan.profile, *args]
        result = self.runner(argv, timeout_s)
        return checked(result) if check else result

    def docker(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = self.runner(["docker", *args], timeout_s)
        return checked(result) if check else result

    # --- looking inside ----------------------------------------------------------------------------------------
    def containers(self, service: str, *, all_states: bool = False) -> list[dict[str, Any]]:
        """Containers of a service (`ps --format json`: one object per line, or one list)."""
        out = self.compose("ps", *(["--all"] if all_states else []), "--format", "json", service,
                           timeout_s=60).stdout.strip()
        rows = json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines() if line]
        return sorted(rows, key=lambda row: row["Name"])

    def logs(self, container: str, *options: str, check: bool = True, timeout_s: float = 300) -> str:
        """`docker logs <options> <container>`: what it printed, stdout and stderr (a restarted container's earlier
        processes included)."""
        result = self.docker("logs", *options, container, check=check, timeout_s=timeout_s)
        return result.stdout + result.stderr

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(self.docker("inspect", container).stdout)[0]

    def container_ip(self, container: str, network: str = "replicas") -> str:
        """The container's address on one of the project's networks (replicas: the proxy's replica URL host)."""
        return self.inspect(container)["NetworkSettings"]["Networks"][f"{self.plan.project}_{network}"]["IPAddress"]

    def read_file(self, service: str, path: str) -> str:
        return self.compose("exec", "-T", service, "cat", path, timeout_s=60).stdout

    def _project_label(self) -> str:
        """The filter that finds what Compose made for this project (one-off `run` containers included)."""
        return f"label=com.docker.compose.project={self.plan.project}"

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes that still exist (by Compose's project label)."""
        label = self._project_label()
        found = {"containers": self.docker("ps", "--all", "--quiet", "--filter", label).stdout.split(),
                 "networks": self.docker("network", "ls", "--quiet", "--filter", label).stdout.split(),
                 "volumes": self.docker("volume", "ls", "--quiet", "--filter", label).stdout.split()}
        return {kind: ids for kind, ids in found.items() if ids}

    # --- the life of the stack ---------------------------------------------------------------------------------
    def save_logs(self, artifacts: Path, name: str) -> Path:
        """Every container of the project (one-offs such as `make train RUN=b` and stopped ones included): its
        state and `docker logs`, which keep what a restarted container printed before it died; for the CI artifact.
        Saved when a test fails, while its containers still exist."""
        artifacts.mkdir(parents=True, exist_ok=True)
        path = artifacts / f"{self.plan.project}-{name}.log"
        ids = self.docker("ps", "--all", "--quiet", "--filter", self._project_label(), check=False).stdout.split()
        with path.open("w") as out:
            for container in ids:
                state = self.docker("inspect", "--format", "{{.Name}} restarts={{.RestartCount}} {{json .State}}",
                                    container, check=False)
                logs = self.logs(container, "--timestamps", check=False, timeout_s=120)
                out.write(f"===== {state.stdout.strip() or container}\n{logs}\n")
        return path

    def remove(self) -> subprocess.CompletedProcess[str]:
        """Containers, networks and volumes of every profile: the next run starts from an empty store."""
        return self.runner(["docker", "compose", "--project-directory", str(self.directory), "--profile", "*",
                            "down", "--volumes", "--remove-orphans", "--timeout", "30"], 600)


class StackSession:
    """`make up` for a test module, and always `down -v` afterwards; logs saved when `make up` failed."""

    def __init__(self, stack: Stack, artifacts: Path, *, wait_timeout_s: int) -> None:
        self.stack = stack
        self.artifacts = artifacts
        self.wait_timeout_s = wait_timeout_s

    def start(self) -> None:
        """`make up` (builds the images by the user's path, then `up --wait`); on failure: logs, `down -v`, raise."""
        try:
            self.stack.make("up", timeout_s=self.wait_timeout_s + 3600)
        except BaseException:
            self.stack.save_logs(self.artifacts, "make-up")
            self.stop()
            raise

    def stop(self) -> None:
        self.stack.remove()
