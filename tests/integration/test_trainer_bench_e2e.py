"""`bench/trainer_bench.py --tiny`: the GPU benchmark's whole path on CPU (stand-in, real AsyncGRPOTrainer, JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]


def test_the_trainer_benchmark_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "bench-trainer.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "trainer_bench.py"), "--tiny", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (result,) = report["configs"]
    assert "error" not in result and result["backend"] == "torch" and result["bf16"] is False
    trl = result["trl"]
    for key in ("perf/fwd_bwd_s", "perf/step_s", "perf/trained_tok_s_wall_clock", "perf/weight_sync_s"):
        assert trl[key]["median"] > 0, key
    assert trl["perf/fwd_bwd_s"]["n"] == result["timed_steps"] == result["trainer_step_s"]["n"]
    assert trl["batch/microbatches_per_step"]["median"] == result["gradient_accumulation_steps"]
    assert 0.8 < trl["ratio"]["median"] < 1.25  # the stand-in's logprobs are the random model's own, about
    assert "| tiny | torch | off |" in done.stdout  # the benchmark's table, printed from the JSON
