"""The tiny model can call a tool: its template renders tools Qwen2.5-style and keeps plain chats byte for byte, each
call is one token that TRL parses into a tool call and trains, and the call tokens come at a few percent after a
tools block, rarely elsewhere, along one direction a rank-1 adapter can move (tasks/tool_lookup.py trains it)."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import random
from pathlib import Path

import pytest
from lorafleet.tiny_vocabulary import MODEL_MARKER, TOOL_CALLS, TOOL_KEYS, TOOL_NAME, WORDS, tool_call_text
from lorafleet_ops.tiny_model import MODEL_VERSION, PLAIN_TEMPLATE, TOOL_SCHEMA, make_tiny_model
from lorafleet_trainer.recipes import TINY_ANCHOR, load_tokenizer, tiny_dataset, tiny_targets
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

REPO = Path(__file__).resolve().parents[3]
TRAINED_VOCAB = 1000  # build_tokenizer's BPE vocabulary; the call tokens come after it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny))  # as the trainer prepares it (TRL's Qwen response template)


@pytest.fixture(scope="module")
def task():
    spec = importlib.util.spec_from_file_location("tool_lookup_task", REPO / "tasks" / "tool_lookup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(key: str) -> dict:
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"key": key}}}


def _ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, return_dict=False, **kwargs)


def test_conversations_without_tools_render_exactly_as_the_plain_template(tokenizer):
    rng = random.Random(3)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))  # noqa: E731
    conversations = [
        [{"role": "user", "content": say()}],
        [{"role": "system", "content": say()}, {"role": "user", "content": say()}],
        [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}, {"role": "user", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": say()},
         {"role": "assistant", "content": say()}],
        *tiny_dataset([1, 2], prompts=4)["prompt"],
    ]
    for messages in conversations:
        for generation_prompt in (False, True):
            new = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            old = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                chat_template=PLAIN_TEMPLATE)
            assert new == old
            assert max(_ids(tokenizer, messages, add_generation_prompt=generation_prompt)) < TRAINED_VOCAB


def test_tools_render_qwen_style_and_the_template_is_prefix_preserving(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what colour is the fox ?"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nbe brief\n\n# Tools\n\n<tools>\n" + json.dumps(TOOL_SCHEMA) + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nwhat colour is the fox ?<|im_end|>\n<|im_start|>assistant\n"
    )
    turn = [{"role": "assistant", "content": "hm", "tool_calls": [_call("fox"), _call("owl")]},
            {"role": "tool", "name": TOOL_NAME, "content": "red"}]
    rendered = tokenizer.apply_chat_template(messages + turn, tools=[TOOL_SCHEMA], tokenize=False)
    assert rendered.endswith(
        f"<|im_start|>assistant\nhm\n{TOOL_CALLS[0]}\n{TOOL_CALLS[1]}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nred\n</tool_response><|im_end|>\n"
    )
    assert is_chat_template_prefix_preserving(tokenizer) and supports_tool_calling(tokenizer)


def test_each_call_is_one_token_trl_parses_into_a_tool_call_and_renders_back_unchanged(tokenizer):
    messages = [{"role": "user", "content": "what colour is the cow ?"}]
    prompt = _ids(tokenizer, messages, tools=[TOOL_SCHEMA], add_generation_prompt=True)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    for offset, key in enumerate(TOOL_KEYS):
        token = TRAINED_VOCAB + offset
        assert tokenizer.decode([token]) == TOOL_CALLS[offset] == tool_call_text(TOOL_NAME, {"key": key})
        assert tokenizer.encode(TOOL_CALLS[offset], add_special_tokens=False) == [token]
        for turn in ([token, im_end], [token]):
            parsed = parse_response(tokenizer, turn, prefix=prompt, tools=[TOOL_SCHEMA])
            assert parsed == {"role": "assistant", "content": "", "tool_calls": [_call(key)]}
        # TRL re-renders the conversation before the next turn: the sampled call must come back as the same token.
        assert _ids(tokenizer, [*messages, parsed], tools=[TOOL_SCHEMA]) == [*prompt, token, im_end, *newline]


def test_trl_rollout_loop_runs_the_call_and_trains_the_call_token(tokenizer, task):
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    worker = _AsyncRolloutLoop(
        model_name="tiny", dataset=task.lookup_dataset(4, 0), reward_funcs=[task.lookup_reward],
        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=multiprocessing.Queue(),
        model_version_value=multiprocessing.Value("i", 0), heartbeat_value=multiprocessing.Value("d", 0.0),
        failed_event=multiprocessing.Event(), exception_info_queue=multiprocessing.Queue(1),
        metrics_queue=multiprocessing.Queue(), tools=[task.lookup], max_tokens=1, **task.trl_args,
    )
    assert worker.chat_template is None  # prefix-preserving: TRL keeps the model's own template
    call, word = TRAINED_VOCAB + TOOL_KEYS.index("bee"), tokenizer.encode(" gold", add_special_tokens=False)[-1]

    def rollout(*turns: list[int]):
        script = list(turns)

        async def generate(prompt_ids):
            ids = script.pop(0)
            return ids, [-1.0] * len(ids)

        worker._generate_one_turn = generate
        prompt = [{"role": "user", "content": "what colour is the bee ?"}]
        return worker._loop.run_until_complete(
            worker._generate_one(prompt, tool_dict={"lookup": task.lookup}, tools=[task.lookup]))

    completion, _, rows, calls, failures, _ = rollout([call], [word])
    assert (calls, failures, len(rows)) == (1, 0, 1)
    assert completion[1] == {"role": "tool", "name": TOOL_NAME, "content": "gold"}
    trained = [token for token, mask in zip(rows[0].input_ids, rows[0].completion_mask, strict=True) if mask]
    assert trained == [call, word]
    assert task.lookup_reward([completion], ["gold"]) == [1.0]
    # Why the task generates one token a turn: text beside a call is parsed into `content`, which renders before the
    # call (whitespace stripped), so the re-rendered turn differs from the sampled one and the call is kept as context.
    completion, _, rows, calls, _, _ = rollout([call, word], [word])
    trained = [token for token, mask in zip(rows[0].input_ids, rows[0].completion_mask, strict=True) if mask]
    assert calls == 1 and call not in trained


def test_every_weight_is_the_version_1_build_and_the_tiny_targets_are_unchanged(tiny, tokenizer):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert json.loads((tiny / MODEL_MARKER).read_text())["version"] == MODEL_VERSION
    config = Qwen2Config.from_pretrained(tiny)
    assert config.vocab_size == len(tokenizer) == TRAINED_VOCAB + len(TOOL_CALLS)
    config.vocab_size = TRAINED_VOCAB
    torch.manual_seed(0)
    before = Qwen2ForCausalLM(config).to(torch.float32).state_dict()
    saved = load_file(str(tiny / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor[: before[name].shape[0]], before[name]), name
    embeddings = saved["model.embed_tokens.weight"]
    anchor = tokenizer.encode(TINY_ANCHOR, add_special_tokens=False)[0]
    version_1 = sorted(int(i) for i in torch.topk(embeddings[:TRAINED_VOCAB] @ embeddings[anchor], 32).indices)
    assert tiny_targets(str(tiny), tokenizer) == version_1


def test_calls_come_at_a_few_percent_after_a_tools_block_and_one_direction_raises_them(tiny, tokenizer, task):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    calls = list(range(TRAINED_VOCAB, len(tokenizer)))
    temperature = task.defaults["temperature"]
    embeddings = model.get_input_embeddings().weight.detach()

    def hidden(messages, tools):
        with torch.no_grad():
            ids = torch.tensor([_ids(tokenizer, messages, tools=tools, add_generation_prompt=True)])
            return model.model(ids).last_hidden_state[0, -1]

    def call_rate(state):
        return torch.softmax(state @ embeddings.T / temperature, -1)[calls].sum().item()

    with_tools = [hidden(messages, [task.lookup]) for messages in task.lookup_dataset(6, 0)["prompt"]]
    plain = [hidden(messages, None) for messages in tiny_dataset([1], prompts=6)["prompt"]]
    assert 0.03 < sum(map(call_rate, with_tools)) / 6 < 0.12
    assert max(map(call_rate, plain)) < 0.005
    # One hidden-state direction lifts all four: the final norm's output turned halfway to the calls' mean direction
    # (same length, as the norm keeps it) samples a call most of the time.
    state, direction = with_tools[0], embeddings[calls].mean(0)
    turned = state / state.norm() + direction / direction.norm()
    assert call_rate(turned / turned.norm() * state.norm()) > 0.3


def test_lookup_task_matches_the_tiny_tool_and_scores_episodes(task, tiny, tokenizer):
    from lorafleet.settings import ConfigError, StackSettings, load_settings
    from transformers.utils import get_json_schema
    from trl.experimental.async_grpo import AsyncGRPOConfig

    assert get_json_schema(task.lookup) == TOOL_SCHEMA  # the schema the call direction was measured after
    assert set(task.defaults) <= set(StackSettings.model_fields)
    assert set(task.trl_args) <= set(AsyncGRPOConfig.__dataclass_fields__)
    built = task.build_task(tokenizer, load_settings(base_model=str(tiny)))
    row = built["train_dataset"][0]
    assert set(row) == {"prompt", "key", "answer"} and task.COLOURS[row["key"]] == row["answer"]
    assert built["tools"] == [task.lookup] and built["eval_dataset"]["prompt"] != built["train_dataset"]["prompt"][:16]

    def episode(key: str) -> list[dict]:
        return [{"role": "assistant", "content": "", "tool_calls": [_call(key)]},
                {"role": "tool", "name": TOOL_NAME, "content": task.lookup(key)},
                {"role": "assistant", "content": "red"}]

    completions = [episode("fox"), episode("cow"), [{"role": "assistant", "content": "red"}], TOOL_CALLS[0], "red"]
    assert task.lookup_reward(completions, ["red"] * 5) == [1.0, 0.5, 0.0, 1.0, 0.0]
    assert task.lookup_reward([episode("fox")], ["red"])[0] >= task.pass_threshold

    class Version1Tokenizer:
        def get_vocab(self):
            return {}

    with pytest.raises(ConfigError, match="make-tiny-model"):
        task.build_task(Version1Tokenizer(), load_settings(base_model=str(tiny)))
