"""Who answered each rollout: the proxy's provenance headers, carried per turn to the trainer and logged per sample.

Every generation answer of the proxy names the replica that answered (`X-Proxy-Upstream`), the weights asked for
by fleet name (`X-Lorafleet-Adapter`) and the fingerprint of the content that replica loaded under that name
(`X-Lorafleet-Fingerprint`), and once its engine attested the adapter, the digest it attested and how long ago
(`X-Lorafleet-Attested`, `X-Lorafleet-Attested-Age`: proxy attestation.py). The rollout child notes one `Answer`
per turn on the rollout's episode (episodes.py, FleetRolloutLoop in fleet_rollouts.py); the scored sample carries
them to the trainer process, where `RolloutRecord` writes one line per sample the trainer reads from TRL's rollout
queue to the run's rollouts.jsonl. A trainer pointed at a plain vLLM server (no proxy) gets no such headers: its
answers name no replica ("").
Story: docs/concepts/provenance.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lorafleet.vllm_api import (
    PROXY_ADAPTER_HEADER,
    PROXY_ATTESTED_AGE_HEADER,
    PROXY_ATTESTED_HEADER,
    PROXY_FINGERPRINT_HEADER,
    PROXY_UPSTREAM_HEADER,
)

from lorafleet_trainer import trl_seam
from lorafleet_trainer.queue_view import QueueView

ROLLOUTS_FILE = "rollouts.jsonl"  # in the run folder: one line per sample the trainer read


@dataclass(frozen=True)
class Answer:
    """One turn of a rollout as the fleet answered it: by which replica, under which name, with which content."""

    replica: str
    adapter: str
    fingerprint: str
    tokens: int  # the tokens this turn generated
    # The digest of the weights the replica's engine held under that name at its last attestation, and that
    # attestation's age in seconds ("" and None: not attested, e.g. a replica that cannot attest).
    attested: str = ""
    attested_age_s: float | None = None


def answer_from(headers: Mapping[str, str], content: Mapping[str, Any]) -> Answer:
    """The provenance of one completion answer: its headers (a case-insensitive mapping, as aiohttp's) and body."""
    choices = content.get("choices") or [{}]
    return Answer(
        replica=headers.get(PROXY_UPSTREAM_HEADER, ""),
        adapter=headers.get(PROXY_ADAPTER_HEADER, ""),
        fingerprint=headers.get(PROXY_FINGERPRINT_HEADER, ""),
        tokens=len(choices[0].get("token_ids") or ()),
        attested=headers.get(PROXY_ATTESTED_HEADER, ""),
        attested_age_s=age_of(headers.get(PROXY_ATTESTED_AGE_HEADER)),
    )


def age_of(value: str | None) -> float | None:
    """The attestation age header as seconds; None when absent or not a number."""
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def logprob_key(trained: np.ndarray) -> str:
    """A sample's name in the loss: the replica's logprobs of its trained tokens, in order, as float32 bytes.

    TRL's packer gives each loss term the sample's float32 logprob at a trained position (p >= 1, mask 1) in
    position order, so a micro-batch's terms of one sample hash to the key its record line carries
    (ratio_by_replica.py joins them). Two samples share a key only when the replica scored them identically."""
    values = np.ascontiguousarray(trained, dtype=np.float32)
    return hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()


def sample_record(sample: Any) -> dict[str, Any]:
    """The rollout record of one scored sample: its prompt group, policy version, trained tokens, answers and key."""
    mask = np.asarray(sample.completion_mask)
    return {
        "group": int(sample.group_id),
        "version": int(sample.model_version),
        "tokens": int(mask.sum()),
        "answers": [asdict(answer) for answer in getattr(sample, "answers", ())],
        "key": logprob_key(np.asarray(sample.old_log_probs)[1:][mask[1:] == 1]),
    }


class RolloutRecord(QueueView):
    """TRL's rollout queue, each sample read from it written to rollouts.jsonl (`{"time", **sample_record}`).

    Whichever process reads the queue writes: the trainer's reader, or TRAINER_FAST_STEP's packing process, to
    which it is sent whole. Samples the reader then drops as stale are recorded too (prompts.jsonl names those
    groups under `dropped`)."""

    def __init__(self, queue: Any, path: Path) -> None:
        super().__init__(queue)
        self.path = path

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self._queue.get(*args, **kwargs)
        line = json.dumps({"time": round(time.time(), 3), **sample_record(sample)})
        with open(self.path, "a", encoding="utf-8") as out:  # one write: lines never interleave
            out.write(line + "\n")
        return sample

    def __reduce__(self) -> tuple[Any, ...]:
        return (RolloutRecord, (self._queue, self.path))


def record_rollouts(trainer: Any, run_dir: Path) -> None:
    """Record every sample rank 0's trainer reads from TRL's rollout queue (call before `train()` builds the
    dataloader, and before resume.PromptTracker.bind wraps the queue again)."""
    if getattr(trainer, "rollout_worker", None) is None:  # TRL builds the queue on rank 0 only
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    trl_seam.wrap_rollout_queue(trainer, lambda queue: RolloutRecord(queue, run_dir / ROLLOUTS_FILE))
