"""The trainer's fast step: what TRL 1.16's AsyncGRPOTrainer step does, without leaving the GPU idle.

Its levers, each computing TRL's loss, one module each:
- **prefetch** (prefetch.py, packing_process.py): `PackingProcess` runs TRL's own planner and collator one step ahead
  in a spawned process that reads TRL's rollout queue (on a thread, `MicroBatchStream(threaded=True)`, packing holds
  the interpreter lock the training thread needs to launch kernels); `MicroBatchStream` hands each micro-batch over
  with the metrics and prompt groups it produced, and samples are dropped as stale against the version they will be
  trained at (`StepVersions`), as TRL drops them;
- **sync-free loss** (loss.py): `compact_batch` makes TRL's boolean-mask selections on the host before the copy,
  `sync_free_loss` is TRL's formula on the compacted tensors with its metrics kept on the GPU until the step ends, and
  `install_indexed_head` gives TRL's log-probability head the scored positions as indices; timing.py's `StepTimer`
  times the step on the GPU, where the host clock would time kernel launches;
- **fused kernels**: Liger-Kernel's RMSNorm, SwiGLU and RoPE (kernels.py's `apply_liger`, where installed) and
  ../fused_lora.py.
options.py says which levers a step uses: on one CUDA process only (`TRAINER_FAST_STEP`); CPU runs and several ranks
keep TRL's step. ../fast_trainer.py is the AsyncGRPOTrainer subclass that wires them in. The equivalence with TRL's
path is tests/unit/trainer/test_fast_step.py (CPU) and `bench/trainer_bench.py --equivalence` (GPU); what each lever
buys: docs/benchmarks/trainer.md.
"""
