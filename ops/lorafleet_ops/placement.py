"""Where replicas and the trainer run on a GPU host in process mode (`lorafleet demo --device gpu`, the GPU tier).

One replica per GPU, or several sharing one, each with its share of the GPU's memory (VLLM_GPU_MEMORY_UTILIZATION);
the trainer on a GPU of its own or sharing the first one. The replicas keep the stack's claim: every one gets the
same pool (VLLM_GPUS) and locks a GPU of it as it starts (lorafleet_vllm.claim), taking each GPU's first share
before any GPU's second, so N replicas on G GPUs put ceil(N / G) on the busiest. The fraction follows vLLM's own
accounting on the card's real size (lorafleet.gpu_sharing.fitting_fraction: each engine holds its fraction plus its
CUDA context, and must find its fraction free when it starts); how many replicas one GPU holds follows from the
fraction (`gpu_shares`), on the replica's side as here, so the two cannot disagree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lorafleet.gpu_sharing import MEMORY_BUDGET, MIN_FRACTION, REFERENCE_CARD_GIB, fitting_fraction
from lorafleet.settings import ConfigError, StackSettings

from lorafleet_ops.host_check import Gpu, NoGpu, nvidia_gpus

DEFAULT_TRAINER_RESERVE = 0.25  # of the trainer's GPU, where it shares one with replicas
FRACTION_VARIABLE = "VLLM_GPU_MEMORY_UTILIZATION"
SETTING_FRACTION: float = StackSettings.model_fields["vllm_gpu_memory_utilization"].default

TrainerPolicy = Literal["auto", "own", "shared"]
TRAINER_POLICIES: tuple[TrainerPolicy, ...] = ("auto", "own", "shared")


class PlacementError(ConfigError):
    """The replicas and the trainer do not fit the GPUs as asked; the message names the setting or option (the CLI
    reports it as it reports a bad setting: one line, exit 2)."""


@dataclass(frozen=True)
class Placement:
    """The replicas' GPU pool and memory fraction, and the trainer's GPU."""

    replica_gpus: tuple[int, ...]
    replicas: int
    memory_fraction: float
    trainer_gpu: int

    @property
    def per_gpu(self) -> int:
        """Replicas on the busiest GPU (the claim fills every GPU's first share before any second)."""
        return math.ceil(self.replicas / len(self.replica_gpus))

    @property
    def trainer_shares(self) -> bool:
        return self.trainer_gpu in self.replica_gpus

    @property
    def wave(self) -> int:
        """Replicas to start at once. vLLM sizes its KV cache from the GPU's free memory while it profiles, so a
        neighbour starting on the same GPU meanwhile skews it (or trips vLLM's profiling assertion): replicas that
        share a GPU start one share at a time, each wave healthy before the next."""
        return len(self.replica_gpus) if self.per_gpu > 1 else self.replicas

    def replica_env(self) -> dict[str, str]:
        """Settings of every replica: GPU mode, the pool each claims a GPU from, its memory fraction."""
        return {"REPLICA_DEVICE": "gpu", "VLLM_GPUS": ",".join(map(str, self.replica_gpus)),
                FRACTION_VARIABLE: str(self.memory_fraction)}

    def trainer_env(self) -> dict[str, str]:
        """Settings of the trainer: its one GPU, as TRAINER_GPUS and as the GPU CUDA shows it (as Compose does)."""
        return {"TRAINER_GPUS": str(self.trainer_gpu), "CUDA_VISIBLE_DEVICES": str(self.trainer_gpu)}

    def describe(self) -> str:
        gpus = ",".join(map(str, self.replica_gpus))
        trainer = "sharing it" if self.trainer_shares else "on its own"
        return (f"{self.replicas} replica(s) on GPU(s) {gpus}, up to {self.per_gpu} per GPU at "
                f"{FRACTION_VARIABLE}={self.memory_fraction}; trainer on GPU {self.trainer_gpu} ({trainer})")


def plan(gpus: Sequence[int], replicas: int, trainer: TrainerPolicy = "auto", fraction: float | None = None,
         trainer_reserve: float = DEFAULT_TRAINER_RESERVE, card_gib: float = REFERENCE_CARD_GIB) -> Placement:
    """Place `replicas` and the trainer on `gpus` (host indices, in order; the trainer takes the first).

    trainer: `own` (a GPU of its own, the replicas on the others), `shared` (the first GPU, with replicas), `auto`
    (own with two GPUs or more). `fraction`: each replica's VLLM_GPU_MEMORY_UTILIZATION; None: the setting's
    default, lowered to what the busiest GPU's replicas (beside the trainer's `trainer_reserve`) can start with on a
    card of `card_gib` (the smallest of `gpus`: `card_gib_of`).
    """
    if not gpus:
        raise PlacementError("no GPU to place replicas on (nvidia-smi lists none, or none is selected)")
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"GPU list {','.join(map(str, gpus))} names a GPU twice")
    if replicas < 1:
        raise PlacementError(f"replicas must be at least 1, got {replicas}")
    if trainer not in TRAINER_POLICIES:
        raise PlacementError(f"trainer placement must be one of {', '.join(TRAINER_POLICIES)}, got {trainer!r}")
    if not 0 <= trainer_reserve < MEMORY_BUDGET:
        raise PlacementError(f"the trainer's memory reserve must be in [0, {MEMORY_BUDGET}), got {trainer_reserve}")
    own = trainer == "own" or (trainer == "auto" and len(gpus) > 1)
    if own and len(gpus) < 2:
        raise PlacementError(f"the trainer on a GPU of its own needs 2 GPUs, {len(gpus)} given ({gpus[0]}): "
                             "share it (trainer placement `shared`) or give more GPUs")
    pool = tuple(gpus[1:]) if own else tuple(gpus)
    per_gpu = math.ceil(replicas / len(pool))
    reserved = 0.0 if own else trainer_reserve  # the first GPU of the pool is the busiest
    fits = fitting_fraction(per_gpu, card_gib, reserved)
    if fraction is None:
        fraction = min(SETTING_FRACTION, fits)
        if fraction < MIN_FRACTION:
            raise PlacementError(f"{per_gpu} replicas per GPU leave each less than {MIN_FRACTION:.0%} of its memory: "
                                 "give the replicas more GPUs")
    elif not 0 < fraction <= 1:
        raise PlacementError(f"{FRACTION_VARIABLE} must be in (0, 1], got {fraction}")
    elif fraction > fits + 1e-9:
        reserve = "" if own else f" beside the trainer's reserve {trainer_reserve}"
        raise PlacementError(
            f"{FRACTION_VARIABLE}={fraction} does not fit: {per_gpu} replica(s) on GPU {pool[0]} ({card_gib:.1f} GiB)"
            f"{reserve} cannot each find {fraction} of it free when they start, with every engine's CUDA context on "
            f"top; set {FRACTION_VARIABLE} to at most {fits}, or give the replicas more GPUs")
    return Placement(replica_gpus=pool, replicas=replicas, memory_fraction=fraction, trainer_gpu=gpus[0])


def card_gib_of(gpus: Sequence[int], query: Callable[[], list[Gpu]] = nvidia_gpus) -> float:
    """The smallest memory (GiB, nvidia-smi's total) of `gpus`: what `plan` sizes the fraction for."""
    try:
        sizes = {gpu.index: gpu.memory_mib for gpu in query()}
    except NoGpu as exc:
        raise PlacementError(str(exc)) from None
    return min(sizes[index] for index in gpus) / 1024


def place(requested: Sequence[int] | None, replicas: int, trainer: TrainerPolicy = "auto",
          trainer_reserve: float = DEFAULT_TRAINER_RESERVE, query: Callable[[], list[Gpu]] = nvidia_gpus,
          option: str = "--gpus") -> Placement:
    """`plan` on this host's GPUs (`detect_gpus`; `requested` checked against them), sized for their real memory;
    nvidia-smi is asked once for both."""
    try:
        listed = query()
    except NoGpu as exc:
        raise PlacementError(str(exc)) from None
    gpus = detect_gpus(requested, lambda: listed, option=option)
    card_gib = card_gib_of(gpus, lambda: listed) if gpus else REFERENCE_CARD_GIB
    return plan(gpus, replicas, trainer, trainer_reserve=trainer_reserve, card_gib=card_gib)


def parse_gpu_list(text: str, option: str) -> list[int]:
    """"0,2" -> [0, 2]; `option` names the setting or flag in the error."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise PlacementError(f"{option} must be GPU indices separated by commas (e.g. 0 or 0,1), got {text!r}")
    return [int(item) for item in items]


def detect_gpus(requested: Sequence[int] | None = None, query: Callable[[], list[Gpu]] = nvidia_gpus,
                visible: str | None = None, option: str = "--gpus") -> list[int]:
    """The host GPUs to use: `requested` (checked against what nvidia-smi lists), else every GPU it lists, limited
    to CUDA_VISIBLE_DEVICES (`visible`; default: this process's) when that names GPUs by index."""
    try:
        found = [gpu.index for gpu in query()]
    except NoGpu as exc:
        raise PlacementError(str(exc)) from None
    if requested:
        missing = sorted(set(requested) - set(found))
        if missing:
            raise PlacementError(f"{option} names GPU(s) {','.join(map(str, missing))} that nvidia-smi does not list "
                                 f"(it lists {','.join(map(str, found))})")
        return list(requested)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return found
    if not visible.strip():
        return []  # CUDA shows this process no GPU
    try:
        shown = parse_gpu_list(visible, "CUDA_VISIBLE_DEVICES")
    except PlacementError:
        raise PlacementError(f"CUDA_VISIBLE_DEVICES={visible} does not name GPUs by index: select them with "
                             f"{option} instead") from None
    return [index for index in shown if index in found]
