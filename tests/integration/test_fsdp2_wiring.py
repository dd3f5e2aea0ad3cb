"""FSDP2 as lorafleet configures it, proven on CPU as far as CPU allows.

The trainer cannot run FSDP2 on CPU (accelerate 1.15 enables FSDP only for GPU process groups: ranks.py), so
this drives accelerate's own FSDP2 preparation (`fsdp2_prepare_model`) and checkpoint functions directly, on
gloo, with exactly the plugin arguments `build_configs` hands accelerate for an FSDP2 plan. On the tiny model
(tied embeddings, like Qwen2.5-Math) with a LoRA adapter: sharding changes no logit, the tied head stays tied,
LoRA weights are DTensors that `full_tensor()` gathers, and a sharded checkpoint written by 2 ranks loads on 1
and on 3 ranks with identical weights (torch's DCP reshards); the final-adapter export, called on every rank,
writes the gathered adapter once (PEFT's save_pretrained on the sharded model failed on an H200).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lorafleet.settings import load_settings
from lorafleet_trainer.config import build_configs
from lorafleet_trainer.ranks import RankPlan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("fsdp2_worker.py")


def _ranks(n: int, tiny_model: Path, checkpoint: Path, plugin_args: dict, mode: str) -> list[dict]:
    results = checkpoint.parent / f"{mode}-{n}"
    results.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(WORKER),
            str(tiny_model), str(checkpoint), json.dumps(plugin_args), mode, str(results)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(path.read_text()) for path in sorted(results.glob("rank*.json"))]
    assert sorted(row["rank"] for row in rows) == list(range(n)), done.stderr[-4000:]
    return rows


def test_fsdp2_shards_the_tied_peft_model_and_its_checkpoint_reshards(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")
    settings = load_settings(base_model=str(tiny_model), adapter_root=tmp_path, trainer_precision="fp32")
    plugin_args = build_configs(settings, replicas=1, ranks=RankPlan(2, "cuda", "fsdp2")).grpo.fsdp_plugin_args
    assert plugin_args["state_dict_type"] == "SHARDED_STATE_DICT"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    rows = {(mode, n): _ranks(n, tiny_model, checkpoint, plugin_args, mode)
            for mode, n in (("save", 2), ("load", 1), ("load", 3))}
    for (_, n), ranks in rows.items():
        for row in ranks:
            assert row["world"] == n and row["sharded"] and row["still_tied"], row
            assert row["logit_gap"] < 1e-5, row
            assert row.get("loaded_equal", True), row
    assert any(entry.name.startswith("pytorch_model_fsdp") for entry in checkpoint.iterdir())
    written = rows["save", 2][0]  # rank 0
    assert written["final_adapter_equal"] and written["final_adapter_tensors"] > 0, written
    assert sorted(p.name for p in tmp_path.iterdir() if "adapter" in p.name) == ["final-adapter"]  # nothing staged
