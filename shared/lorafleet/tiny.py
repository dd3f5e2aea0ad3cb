"""An offline tiny Qwen2 model and real PEFT adapters for it, built in seconds with no download.

Tests, the demo and the benchmarks serve this model with real vLLM on CPU. Everything is seeded,
so two builds give identical files (replicas built separately serve identical weights).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lorafleet.peft_adapter import write_lora_adapter

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORDS = (
    "the a an one two three four five six seven eight nine zero cat dog fox owl bee ant cow red blue green "
    "black white gold big small fast slow is was and or not yes no + - * = ? what sum of plus minus times"
).split()
MODEL_MARKER = "lorafleet-tiny.json"


def _corpus(seed: int, sentences: int = 20_000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "shu", "gra", "tol", "bin", "dex"]
    made_up = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(1500)]
    vocab = WORDS + made_up
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 30))) for _ in range(sentences)]


def build_tokenizer(seed: int = 0, vocab_size: int = 1000):  # -> PreTrainedTokenizerFast
    """A real byte-level BPE tokenizer trained offline on a seeded synthetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a deterministic random Qwen2ForCausalLM (hidden 128, 2 layers, 4 heads, 2 KV heads) to `out_dir`.

    Idempotent: a directory already holding a model built with the same seed is left alone, before torch is even
    imported (the stack's one-shot `tiny-model` service runs again at every `make scale`).
    """
    out = Path(out_dir)
    marker = out / MODEL_MARKER
    if marker.exists() and json.loads(marker.read_text()).get("seed") == seed:
        return out
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps({"seed": seed, "kind": "qwen2-tiny"}))
    return out


def make_adapter(
    out_dir: str | Path, model_dir: str | Path, rank: int = 1, seed: int = 0, alpha: int | None = None
) -> Path:
    """Write a real PEFT LoRA adapter (all linear layers) for the model in `model_dir`, seeded and non-zero."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    return write_lora_adapter(Path(out_dir), config, str(model_dir), rank=rank, alpha=alpha, seed=seed)
