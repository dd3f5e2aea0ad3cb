"""The replica's vLLM plugin (lorafleet_vllm/inplace_reload.py) on the pinned vLLM's own `OpenAIServingModels`: an
in-place load reaches the engine as one, and the request stored for generations no longer asks for a reload. Without
the plugin vLLM stores the flag (the defect, shown here), and the worker reloads the files at every step.
(tests/integration/test_inplace_reload.py shows the effect on a real replica.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from lorafleet_vllm.inplace_reload import MARK, clear_after_load, patch
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
from vllm.lora.request import LoRARequest

# vLLM's own method, whether or not vLLM loaded the plugin in this process
ORIGINAL = getattr(OpenAIServingModels.load_lora_adapter, "__wrapped__", OpenAIServingModels.load_lora_adapter)


class Engine:
    """The engine client's part a load uses: `add_lora` records what reached the engine (as a real engine client's
    message does, by value), or fails."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=512)
        self.renderer = self.input_processor = None  # read by the constructor, unused by a load
        self.added: list[tuple[str, bool]] = []
        self.fail = False

    async def add_lora(self, request: LoRARequest) -> bool:
        if self.fail:
            raise RuntimeError("the adapter's files could not be read")
        self.added.append((request.lora_path, request.load_inplace))
        return True


def serving(engine: Engine) -> OpenAIServingModels:
    return OpenAIServingModels(engine, base_model_paths=[])  # type: ignore[arg-type]


def load(models: OpenAIServingModels, load: Any, path: str, inplace: bool) -> Any:
    request = LoadLoRAAdapterRequest(lora_name="trl-policy-v3", lora_path=path, load_inplace=inplace)
    return asyncio.run(load(models, request))


def test_the_pinned_vllm_keeps_the_flag_on_the_request_every_generation_gets() -> None:
    models = serving(Engine())
    load(models, ORIGINAL, "/adapters/a", inplace=False)
    load(models, ORIGINAL, "/adapters/b", inplace=True)
    assert models.lora_requests["trl-policy-v3"].load_inplace, "vLLM no longer keeps the flag: the plugin can go"


def test_an_inplace_load_reaches_the_engine_once_and_is_not_stored() -> None:
    engine = Engine()
    models = serving(engine)
    wrapped = clear_after_load(ORIGINAL)
    load(models, wrapped, "/adapters/a", inplace=False)
    first_id = models.lora_requests["trl-policy-v3"].lora_int_id
    assert "Success" in load(models, wrapped, "/adapters/b", inplace=True)
    assert engine.added == [("/adapters/a", False), ("/adapters/b", True)]
    stored = models.lora_requests["trl-policy-v3"]
    assert (stored.lora_path, stored.lora_int_id, stored.load_inplace) == ("/adapters/b", first_id, False)

    engine.fail = True  # a reload that fails leaves the stored request as it was
    answer = load(models, wrapped, "/adapters/c", inplace=True)
    assert getattr(answer, "error", None) is not None
    assert models.lora_requests["trl-policy-v3"] is stored and not stored.load_inplace


def test_patch_wraps_the_method_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OpenAIServingModels, "load_lora_adapter", ORIGINAL)
    assert patch() is True
    wrapped = OpenAIServingModels.load_lora_adapter
    assert getattr(wrapped, MARK) and wrapped.__wrapped__ is ORIGINAL
    assert patch() is False and OpenAIServingModels.load_lora_adapter is wrapped
