"""What the offline tiny model is made of, as far as the trainer needs to know it: the words of its vocabulary (the
tiny task writes its prompts in them), its one tool and how a call to it reads (tasks/tool_lookup.py), and the marker
file that tells a tiny model's directory apart. The builder (lorafleet_ops.tiny_model) makes the model from these."""

from __future__ import annotations

import json
from typing import Any

WORDS = (
    "the a an one two three four five six seven eight nine zero cat dog fox owl bee ant cow red blue green "
    "black white gold big small fast slow is was and or not yes no + - * = ? what sum of plus minus times"
).split()
MODEL_MARKER = "lorafleet-tiny.json"
TOOL_NAME = "lookup"
TOOL_KEYS = ("fox", "owl", "bee", "cow")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One tool call exactly as the tiny model's chat template renders it (and as TRL's Qwen response template parses
    it): one token of the tiny model per call in TOOL_CALLS."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


TOOL_CALLS = tuple(tool_call_text(TOOL_NAME, {"key": key}) for key in TOOL_KEYS)
