"""An offline tiny Qwen2 model and real PEFT adapters for it, built in seconds with no download.

Tests, the demo and the benchmarks serve this model with real vLLM on CPU. Everything is seeded,
so two builds give identical files (replicas built separately serve identical weights).

The model can call one tool, `lookup(key)`, for the keys in TOOL_KEYS (tasks/tool_lookup.py trains it): its chat
template renders `tools`, tool calls and tool results the way Qwen2.5's does, and each whole call
(`<tool_call>\n{"name": "lookup", "arguments": {"key": "fox"}}\n</tool_call>`) is one added token, so a random-weight
model emits a complete, parseable call in one step. The call tokens' embeddings share one direction, the one the
final hidden state takes after a tools block and not after plain text: ~6% of tokens sampled at temperature 0.4
after a tools block are calls, ~0.1% elsewhere (the tiny task's rollouts stay free of tool calls), and one
hidden-state direction (one LoRA rank) raises them all.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lorafleet.tiny_vocabulary import MODEL_MARKER, TOOL_CALLS, TOOL_NAME, WORDS

from lorafleet_ops.peft_adapter import write_lora_adapter

PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML; with `tools`, Qwen2.5's layout in brief: a system block listing the tools' JSON schemas in <tools></tools>
# (a system message first joins it), each call `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after
# the content, each tool result a user turn in <tool_response></tool_response>. Prefix-preserving: a message renders
# the same whatever follows it. Without tools, tool calls or tool messages it renders exactly as PLAIN_TEMPLATE.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
MODEL_VERSION = 2  # 2: the tool-call tokens (rows appended; every other weight as version 1 built them)

# The tool the call direction is measured with: what transformers' get_json_schema makes of tasks/tool_lookup.py's
# `lookup` (a test keeps the two equal).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "The colour of an animal.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The animal."}},
            "required": ["key"],
        },
        "return": {"type": "string"},
    },
}
# Norm of a call token's embedding (an ordinary token's is ~0.23): sets the base rate of calls after a tools block.
TOOL_CALL_SCALE = 0.22
TINY_TASK_ANCHOR = " cat"  # recipes.TINY_ANCHOR: the call direction is kept orthogonal to the tiny task's


def _corpus(seed: int, sentences: int = 20_000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "shu", "gra", "tol", "bin", "dex"]
    made_up = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(1500)]
    vocab = WORDS + made_up
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 30))) for _ in range(sentences)]




def build_tokenizer(seed: int = 0, vocab_size: int = 1000):  # -> PreTrainedTokenizerFast
    """A real byte-level BPE tokenizer trained offline on a seeded synthetic corpus, plus one token per TOOL_CALLS.

    The call tokens come after the `vocab_size` trained ones and are not special: decoding keeps them (vLLM's
    detokenizer and TRL's plain-text fallback skip special tokens), and text never containing a whole call
    tokenizes as before.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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
    fast.add_tokens([AddedToken(text, special=False, normalized=False) for text in TOOL_CALLS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tool_probe_prompts(seed: int = 0, count: int = 16) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(prompts the model sees with TOOL_SCHEMA, plain prompts): short questions, and prompts like the tiny task's."""
    rng = random.Random(seed + 7)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    with_tools = [[{"role": "user", "content": words(3, 12)}] for _ in range(count)]
    plain = [[{"role": "user", "content": words(3, 12) if index % 2 else words(60, 100)}] for index in range(count)]
    return with_tools, plain


def _tool_call_rows(model: Any, tokenizer: Any, seed: int) -> Any:
    """Embeddings for the TOOL_CALLS tokens: TOOL_CALL_SCALE along the call direction, plus a little seeded noise.

    The call direction is where the final hidden state after a tools block differs from the one after plain text
    (mean over tool_probe_prompts), less its component along the tiny task's anchor (so `tiny_targets` is unchanged
    and training one task does not raise the other's tokens). Measured in float64 and rounded to a 2**-12 grid, so
    separately built copies agree bit for bit.
    """
    import copy

    import torch

    probe = copy.deepcopy(model).to(torch.float64).eval()
    with_tools, plain = tool_probe_prompts(seed)

    def mean_hidden(prompts: list[list[dict[str, str]]], tools: list[dict[str, Any]] | None) -> Any:
        states = []
        for messages in prompts:
            ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)
            with torch.no_grad():
                states.append(probe.model(torch.tensor([ids])).last_hidden_state[0, -1])
        return torch.stack(states).mean(0)

    direction = mean_hidden(with_tools, [TOOL_SCHEMA]) - mean_hidden(plain, None)
    embeddings = probe.model.embed_tokens.weight.detach()
    anchor = embeddings[tokenizer.encode(TINY_TASK_ANCHOR, add_special_tokens=False)[0]]
    anchor = anchor / anchor.norm()
    direction = direction - (direction @ anchor) * anchor
    direction = torch.round(direction / direction.norm() * 4096) / 4096
    direction = direction / direction.norm()
    noise = torch.randn(
        len(TOOL_CALLS), direction.numel(), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    return (TOOL_CALL_SCALE * direction + 0.004 * noise).to(torch.float32)


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a deterministic random Qwen2ForCausalLM (hidden 128, 2 layers, 4 heads, 2 KV heads) to `out_dir`.

    Every weight is drawn as before the tool-call tokens existed; their embedding rows are appended after
    (`_tool_call_rows`). Idempotent: a directory already holding a model of this version built with the same seed is
    left alone, before torch is even imported (the stack's one-shot `tiny-model` service runs again at every
    `make scale`); one of an older version is rebuilt in place.
    """
    out = Path(out_dir)
    marker = out / MODEL_MARKER
    if marker.exists():
        built = json.loads(marker.read_text())
        if built.get("seed") == seed and built.get("version", 1) == MODEL_VERSION:
            return out
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(seed)
    trained_vocab = len(tokenizer) - len(TOOL_CALLS)
    config = Qwen2Config(
        vocab_size=trained_vocab,
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
    rows = _tool_call_rows(model, tokenizer, seed)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[trained_vocab:] = rows
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps({"seed": seed, "kind": "qwen2-tiny", "version": MODEL_VERSION}))
    return out


def make_adapter(
    out_dir: str | Path, model_dir: str | Path, rank: int = 1, seed: int = 0, alpha: int | None = None
) -> Path:
    """Write a real PEFT LoRA adapter (all linear layers) for the model in `model_dir`, seeded and non-zero."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    return write_lora_adapter(Path(out_dir), config, str(model_dir), rank=rank, alpha=alpha, seed=seed)
