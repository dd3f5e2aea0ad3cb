"""Benchmark-only: lets TRL's rollout worker start with no vLLM installed (generation is bench/vllm_standin.py).

On PYTHONPATH only in bench/launcher_bench.py's trainer processes, so every process `lorafleet-train` starts (its
launched ranks too, which run `python -m lorafleet_trainer.main` afresh) gets it; production never does.
"""

import os

if os.environ.get("LORAFLEET_BENCH_STANDIN") == "1":
    from trl.experimental.async_grpo import async_rollout_worker

    async_rollout_worker.is_vllm_available = lambda *_: True
