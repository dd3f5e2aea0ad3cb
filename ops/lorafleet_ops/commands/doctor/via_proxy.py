"""The probe's reach to a replica it cannot ask directly: everything goes through the proxy's fleet port.

The trainer's container sees the replicas only through the proxy (an internal network, vLLM's key),
so the probe observes such a replica in the proxy's GET /fleet, pauses and resumes it through the
proxy's broadcasts, and proves it generates by sending completions through the proxy until the
proxy's `X-Proxy-Upstream` header has named it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER, VLLMClient, VLLMError

ATTEMPTS_PER_REPLICA = 8


class ProxiedReplica:
    """One replica, observed and acted on through the proxy: the calls the probe makes on a direct client."""

    def __init__(self, url: str, proxy: VLLMClient) -> None:
        self.url = url
        self.proxy = proxy

    async def loaded_adapters(self) -> dict[str, str]:
        """Its adapters (name -> path) as the proxy last read them."""
        for item in (await self.proxy.request("GET", "/fleet")).json().get("replicas", []):
            if str(item.get("url", "")).rstrip("/") == self.url:
                return dict(item.get("adapters") or {})
        raise VLLMError(404, f"the proxy no longer lists {self.url}", "NotFoundError")

    async def is_paused(self) -> bool:
        """The proxy's /is_paused: true when any ready replica is; a pause broadcast fails unless all paused."""
        return await self.proxy.is_paused()

    async def resume(self) -> None:
        await self.proxy.resume()

    async def load_lora_adapter(self, name: str, path: str) -> str:
        return await self.proxy.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> str:
        """Unload through the proxy; 404 when it does not hold `name`, 409 when it still does afterwards."""
        if name not in await self.loaded_adapters():
            raise VLLMError(404, f"{name} is not loaded on {self.url} (seen through the proxy)", "NotFoundError")
        try:
            answer = await self.proxy.unload_lora_adapter(name)
        except VLLMError as exc:
            answer = str(exc)
        if name in await self.loaded_adapters():
            raise VLLMError(409, f"{self.url} still holds {name} (seen through the proxy): {answer}", "Conflict")
        return answer

    async def aclose(self) -> None:
        """The proxy's client is closed by its owner."""


def coverage(targets: Sequence[str], answered: set[str], attempts: int, errors: Sequence[str]) -> dict[str, str | None]:
    """Each target -> None when it answered at least once, else why it is taken as not generating."""
    last = f" (last error: {errors[-1]})" if errors else ""
    reason = f"never answered any of {attempts} completion(s) with the probe through the proxy{last}"
    return {url: None if url in answered else reason for url in targets}


async def generate_through_proxy(proxy: VLLMClient, name: str, prompt: str, targets: Sequence[str], routed: int,
                                 timeout: float) -> dict[str, str | None]:
    """Send completions naming adapter `name` through the proxy, each with its own prompt (no prefix-cache
    affinity), until every target has answered once or ATTEMPTS_PER_REPLICA x `routed` (the replicas the
    proxy routes to) were sent. The proxy routes only to replicas holding `name`."""
    answered: set[str] = set()
    errors: list[str] = []
    attempts = ATTEMPTS_PER_REPLICA * max(routed, len(targets))
    sent = 0
    while sent < attempts and not answered.issuperset(targets):
        body = {"model": name, "prompt": f"{sent} {prompt}", "max_tokens": 2, "temperature": 0.0}
        sent += 1
        try:
            response = await proxy.request("POST", "/v1/completions", json_body=body, timeout=timeout)
        except VLLMError as exc:
            errors.append(str(exc))
            continue
        if response.json().get("choices"):
            answered.add(response.headers.get(PROXY_UPSTREAM_HEADER, "").rstrip("/"))
        else:
            errors.append(f"no choices in {response.text[:200]}")
    return coverage(targets, answered, sent, errors)
