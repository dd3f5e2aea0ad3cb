"""The run folder's checkpoints, read without torch or transformers: discovery for resume, completeness, retention
(checkpoints, published versions), and the final adapter a finished run's checkpoint leaves.

Light on purpose: the start's checks (start_checks.py) read the newest checkpoint before anything heavy is imported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from lorafleet.adapters import policy_version
from lorafleet.logs import log_event
from lorafleet.settings import ConfigError

from lorafleet_trainer.safetensors_bytes import same_tensors

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger("lorafleet_trainer.run_state")  # the lines' logger before the split: logs unchanged
FINAL_ADAPTER = "final-adapter"
FSDP_MODEL_DIR = "pytorch_model_fsdp"  # accelerate's FSDP_MODEL_NAME: the prefix of a sharded model state's folder
ROLLOUT_STATE = "rollout_state.json"  # TRL's file; lorafleet adds the consumed prompts (resume.py)
TRAINER_STATE = "trainer_state.json"  # transformers writes it last
WRITING_MARKER = ".lorafleet-writing"  # created before a checkpoint's first file, removed after its last


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    model_version: int | None  # TRL's rollout_state.json; None = numbering restarts at v1
    prompt_index: int = 0  # the first prompt-stream position not consumed (resume.py); TRL's reader resumes here
    consumed_above: tuple[int, ...] = ()  # consumed positions past prompt_index (written by lorafleet only)

    @property
    def sharded(self) -> bool:
        """Written by FSDP2 ranks (a sharded state dict, torch DCP), not as a full adapter + optimizer.pt."""
        return any(entry.is_dir() and entry.name.startswith(FSDP_MODEL_DIR) for entry in self.path.iterdir())


def check_resumable(checkpoint: Checkpoint, fsdp2: bool) -> None:
    """Refuse a checkpoint the planned ranks cannot load, naming the settings that can.

    A full checkpoint (one rank, or DDP ranks: rank 0 saves the adapter and optimizer.pt) loads on any rank
    count without FSDP; a sharded one (FSDP2) only under FSDP2, where torch's DCP reshards it to the rank count.
    """
    if checkpoint.sharded and not fsdp2:
        raise ConfigError(
            f"{checkpoint.path} was written by FSDP2 ranks (a sharded state dict): resume it with "
            f"TRAINER_SHARDING=fsdp2 on two or more GPUs (TRAINER_GPUS), or start a new RUN_NAME"
        )
    if fsdp2 and not checkpoint.sharded:
        raise ConfigError(
            f"{checkpoint.path} holds a full adapter and optimizer (one rank or DDP), which FSDP2 ranks do not load: "
            f"resume it with TRAINER_SHARDING=ddp (any rank count) or one GPU, or start a new RUN_NAME"
        )


def checkpoint_complete(path: Path) -> bool:
    """Written to the end: no marker of a save a kill cut short, and a trainer_state.json that parses.

    transformers writes checkpoint-N in place (no temporary folder and rename), trainer_state.json last; lorafleet's
    save (resume.py) adds a marker before the first file and removes it after the last. Checkpoints written before
    the marker existed count as complete when their trainer_state.json parses.
    """
    if (path / WRITING_MARKER).exists():
        return False
    try:
        json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return False
    return True


def newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The highest-step complete checkpoint in `run_dir`; newer incomplete ones are logged and passed over."""
    if not run_dir.is_dir():
        return None
    found = sorted(
        ((int(match.group(1)), entry) for entry in run_dir.iterdir()
         if (match := CHECKPOINT_PATTERN.match(entry.name)) and entry.is_dir()),
        reverse=True,
    )
    for step, path in found:
        if checkpoint_complete(path):
            return _read_checkpoint(path, step)
        log_event(log, "checkpoint_incomplete", logging.WARNING, checkpoint=path,
                  action="passed over (a save cut short): the newest complete one, if any, is resumed from")
    return None


def _read_checkpoint(path: Path, step: int) -> Checkpoint:
    state_file = path / ROLLOUT_STATE
    if not state_file.is_file():
        return Checkpoint(path=path, step=step, model_version=None)
    state = json.loads(state_file.read_text())
    return Checkpoint(path=path, step=step, model_version=state.get("model_version"),
                      prompt_index=int(state.get("prompt_index", 0)),
                      consumed_above=tuple(int(position) for position in state.get("consumed_above", ())))


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (by step number) and leftovers of crashed saves.

    By step, not mtime (transformers' save_total_limit sorts by mtime, which a copied or restored run
    folder scrambles). An incomplete checkpoint newer than the newest complete one is left alone: it may
    be the one being written. keep=0 keeps everything.
    """
    if keep <= 0 or not run_dir.is_dir():
        return []
    found = sorted(
        (int(match.group(1)), entry) for entry in run_dir.iterdir()
        if (match := CHECKPOINT_PATTERN.match(entry.name)) and entry.is_dir()
    )
    complete = [step for step, entry in found if checkpoint_complete(entry)]
    kept = set(complete[-keep:])
    newest = max(complete, default=-1)
    doomed = [entry for step, entry in found if step not in kept and step < newest]
    for entry in doomed:
        shutil.rmtree(entry, ignore_errors=True)
    if doomed:
        log_event(log, "checkpoints_pruned", deleted=",".join(entry.name for entry in doomed), kept=len(kept))
    return doomed


def prune_versions(lora_dir: Path, keep: int) -> list[Path]:
    """Delete the published `trl-policy-v*` folders more than `keep` - 1 versions behind the newest one.

    TRL keeps MAX_STALENESS + 2 versions by deleting one folder per sync, the one `keep` versions behind the version
    it publishes; a start killed between its publish and that delete leaves that folder behind for good, since no
    later sync names it again. Versions that far behind are unloaded (by TRL, or by the start-up sweep) and no
    rollout may use them any more (MAX_STALENESS), so the window is the same as TRL's, counted from what is on disk.
    """
    found = sorted(
        (version, entry) for entry in (lora_dir.iterdir() if lora_dir.is_dir() else ())
        if (version := policy_version(entry.name)) and entry.is_dir()
    )
    if not found:
        return []
    oldest_kept = found[-1][0] - keep + 1
    doomed = [entry for version, entry in found if version < oldest_kept]
    for entry in doomed:
        shutil.rmtree(entry, ignore_errors=True)
    if doomed:
        log_event(log, "versions_pruned", deleted=",".join(entry.name for entry in doomed), kept_from=oldest_kept,
                  reason="left behind by a start stopped between a publish and TRL's delete")
    return doomed


def replace_whole(staged: Path, target: Path) -> Path:
    """Put the folder `staged` at `target`, replacing an older one whole (never half of each)."""
    if target.exists():
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(staged, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staged, target)
    return target


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's, in a full checkpoint and an export


def final_adapter_from(checkpoint: Checkpoint, run_dir: Path) -> Path | None:
    """<run>/final-adapter with `checkpoint`'s adapter weights, for a start that finds the run already finished.

    A kill after the last checkpoint but before the export leaves final-adapter/ missing, or an earlier start's. Kept
    as it is when it holds the checkpoint's tensors already; None when it is absent and the checkpoint holds no full
    adapter to copy (FSDP2 writes a sharded state).
    """
    target = run_dir / FINAL_ADAPTER
    weights = ADAPTER_FILES[1]
    if not all((checkpoint.path / name).is_file() for name in ADAPTER_FILES):
        return target if target.is_dir() else None
    if (target / weights).is_file() and same_tensors(target / weights, checkpoint.path / weights):
        return target
    staged = run_dir / f".{FINAL_ADAPTER}.new"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for name in ADAPTER_FILES:
        shutil.copy2(checkpoint.path / name, staged / name)
    log_event(log, "final_adapter_restored", checkpoint=checkpoint.path, adapter=target,
              reason="the start that reached the checkpoint stopped before it exported final-adapter")
    return replace_whole(staged, target)
