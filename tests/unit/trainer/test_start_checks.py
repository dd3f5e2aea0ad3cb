"""The start's cheap refusals cost no heavy import: a start refused for low disk, or one that finds its run already
complete, ends before torch, transformers or TRL is imported (the real entry point, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
HEAVY = ("torch", "transformers", "trl")


def _run_entry_point(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`lorafleet-train` (its module's __main__: entry()) under `python -X importtime`, which lists every import."""
    full = {**os.environ, "LORAFLEET_ENV_FILE": "", "TRAINER_VLLM_URL": "http://127.0.0.1:9", **env}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "lorafleet_trainer.main"], env=full,
                          capture_output=True, text=True, timeout=90, check=False)


def _imported(stderr: str) -> set[str]:
    """The top-level packages `-X importtime` saw imported ("import time: self | cumulative | name" lines)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_a_start_refused_for_low_disk_imports_no_torch(tmp_path):
    done = _run_entry_point({"ADAPTER_ROOT": str(tmp_path), "TRAINER_MIN_FREE_GB": "1000000"})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "event=refused" in done.stderr and "TRAINER_MIN_FREE_GB=1e+06" in done.stderr
    imported = _imported(done.stderr)
    assert "lorafleet_trainer" in imported, "importtime saw the trainer's own imports"
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_start_that_finds_its_run_complete_imports_no_torch(tmp_path):
    checkpoint = tmp_path / "runs" / "done" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "rollout_state.json").write_text(json.dumps({"model_version": 4}))
    done = _run_entry_point({"ADAPTER_ROOT": str(tmp_path), "RUN_NAME": "done", "MAX_STEPS": "3",
                             "TRAINER_MIN_FREE_GB": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already_complete=True" in done.stderr
    imported = _imported(done.stderr)
    assert "lorafleet_trainer" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_the_check_modules_import_nothing_heavy():
    """Imported alone, the check phase's module reaches no heavy package (what the two starts above rely on)."""
    code = ("import sys, lorafleet_trainer.start_checks, lorafleet_trainer.main;"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "LORAFLEET_ENV_FILE": ""})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_the_probe_sees_a_heavy_import():
    """The probe can fail: importing torch under -X importtime names it (so an import of it would be seen)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True,
                         timeout=90, check=True)
    assert "torch" in _imported(out.stderr)


PHASES = {"main.py": ("train", "start_rollout_server", "configure_run", "ready_fleet", "build", "build_trainer",
                      "wire", "run_until_stopped", "run", "finish"),
          "start_checks.py": ("refuse_spent_start", "check_start")}


def test_train_and_each_phase_are_short():
    """train() reads as its phases in order; none of them is over 40 lines."""
    import ast

    import lorafleet_trainer

    folder = Path(lorafleet_trainer.__file__).parent
    lengths = {}
    for module, names in PHASES.items():
        functions = {node.name: node for node in ast.parse((folder / module).read_text()).body
                     if isinstance(node, ast.FunctionDef)}
        lengths.update({name: functions[name].end_lineno - functions[name].lineno + 1 for name in names})
    assert max(lengths.values()) <= 40, {name: length for name, length in lengths.items() if length > 40}
