"""Which of the fast step's levers a step uses: `StepOptions`, and TRAINER_FAST_STEP resolved for this process.

Apart from the levers so that main.py and the benchmark can choose a step without importing torch or TRL.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepOptions:
    """Which speed-ups the trainer's step uses (each one is a configuration of `make bench-trainer`)."""

    prefetch: bool = False
    sync_free_loss: bool = False
    fused_lora: bool = False
    liger: bool = False
    # Where prefetching packs: "process" (a spawned packing process: TRL's packing is pure Python, and on a thread
    # it holds the interpreter lock the training thread needs to launch the GPU's kernels) or "thread".
    packing: str = "process"
    # With "thread": Python's thread switch interval (s) while packing ahead; 0 = Python's default (5 ms).
    switch_interval_s: float = 0.0

    @property
    def custom_trainer(self) -> bool:
        """Whether TRL's trainer class needs lorafleet's subclass (the data and loss levers live there)."""
        return self.prefetch or self.sync_free_loss

    def summary(self) -> dict[str, bool]:
        return {"prefetch": self.prefetch, "sync_free_loss": self.sync_free_loss, "fused_lora": self.fused_lora,
                "liger": self.liger, "packing": self.packing if self.prefetch else None,
                "switch_interval_s": self.switch_interval_s}


PLAIN = StepOptions()
FAST = StepOptions(prefetch=True, sync_free_loss=True, fused_lora=True, liger=True)


def step_options(enabled: bool, *, device: str, sharding: str) -> StepOptions:
    """TRAINER_FAST_STEP resolved for this process: the fast step on one CUDA process, TRL's step elsewhere.

    Several ranks (DDP, FSDP2) and CPU runs keep TRL's step: the fast one is measured on one GPU only.
    """
    if enabled and device == "cuda" and sharding == "none":
        return FAST
    return PLAIN
