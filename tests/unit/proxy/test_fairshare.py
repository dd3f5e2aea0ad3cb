"""The fair-share queue (virtual token counter): shares follow weights in tokens, a burst cannot starve a run,
a lone run never waits, and a client that leaves while queued gives its place back."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_proxy.runs.fairshare import FairShare, estimate_tokens, prompt_tokens


async def serve(fair: FairShare, demands: dict[str, tuple[float, int, int]], slots: int) -> dict[str, int]:
    """Runs flood `fair` (run -> (weight, requests, tokens each)); the first `slots` admitted requests of the
    contended phase are counted (tokens per run): the share each run got while all of them had work waiting."""
    served: dict[str, int] = dict.fromkeys(demands, 0)
    order: list[str] = []
    gate = asyncio.Event()

    async def one(run: str, weight: float, tokens: int) -> None:
        await fair.enter(run, weight, tokens)
        order.append(run)
        await gate.wait()
        await asyncio.sleep(0)
        fair.leave(run, tokens, tokens)

    tasks = [asyncio.ensure_future(one(run, weight, tokens))
             for run, (weight, count, tokens) in demands.items() for _ in range(count)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks)
    for run in order[fair.window():][:slots]:  # after the window the first comers filled
        served[run] += demands[run][2]
    return served


async def test_equal_weights_share_tokens_equally_whatever_the_burst() -> None:
    fair = FairShare(lambda: 4)
    served = await serve(fair, {"burst": (1.0, 400, 10), "steady": (1.0, 40, 10)}, 60)
    assert abs(served["burst"] - served["steady"]) <= fair.window() * 10, served  # at most a window apart


async def test_weights_set_the_share_in_tokens_not_requests() -> None:
    fair = FairShare(lambda: 2)
    served = await serve(fair, {"heavy": (2.0, 300, 30), "light": (1.0, 300, 10)}, 60)
    assert served["heavy"] / (served["heavy"] + served["light"]) == pytest.approx(2 / 3, abs=0.05)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=4),
       tokens=st.lists(st.integers(1, 50), min_size=4, max_size=4))
def test_every_backlogged_run_gets_its_weighted_share(weights: list[float], tokens: list[int]) -> None:
    slots = 40 * len(weights)
    demands = {f"r{i}": (weight, slots + 10, tokens[i]) for i, weight in enumerate(weights)}  # backlogged throughout
    served = asyncio.run(serve(FairShare(lambda: 3), demands, slots))
    total = sum(served.values())
    for run, (weight, _, _) in demands.items():
        expected = weight / sum(w for w, _, _ in demands.values())
        # within a few requests' worth of tokens of the exact share (counters move in whole requests)
        assert abs(served[run] / total - expected) <= 3 * max(tokens) / total + 0.02, (run, served)


async def test_a_lone_run_never_waits() -> None:
    fair = FairShare(lambda: 1)
    assert await fair.enter("a", 1.0, 10) == 0.0 or fair.inflight == 1
    fair.leave("a", 10, 4)
    for _ in range(5):
        await fair.enter("a", 1.0, 10)
        fair.leave("a", 10, 10)
    assert fair.inflight == 0 and fair.waiting("a") == 0


async def test_a_client_that_leaves_while_queued_gives_its_place_back() -> None:
    fair = FairShare(lambda: 1)
    await fair.enter("a", 1.0, 10)
    queued = asyncio.ensure_future(fair.enter("b", 1.0, 10))
    await asyncio.sleep(0)
    assert fair.waiting("b") == 1
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert fair.waiting("b") == 0
    fair.leave("a", 10, 10)
    assert fair.inflight == 0


def test_estimates_count_prompt_tokens_and_the_tokens_a_request_may_generate() -> None:
    assert prompt_tokens({"prompt": list(range(40))}) == 40
    assert prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_tokens({"prompt": list(range(40)), "max_tokens": 8, "n": 2}, 40) == 56
    assert estimate_tokens({"prompt": "x" * 40}, prompt_tokens({"prompt": "x" * 40})) == 10 + 16


async def test_closed_loop_clients_get_their_weighted_share_while_requests_are_in_flight() -> None:
    """Sixteen clients per run, each waiting for its answer before the next request (as rollout workers do), eight
    requests in flight on the fleet: served requests follow the weights 1:1:2:4 within 10%."""
    fair = FairShare(lambda: 8)
    weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    done = dict.fromkeys(weights, 0)
    loop = asyncio.get_running_loop()
    stop = loop.time() + 1.5

    async def client(run: str) -> None:
        while loop.time() < stop:
            await fair.enter(run, weights[run], 67)
            await asyncio.sleep(0.005)  # the replica's work
            fair.leave(run, 67, 64 + 3)
            done[run] += 1

    await asyncio.gather(*(client(run) for run in weights for _ in range(16)))
    total = sum(done.values())
    for run, weight in weights.items():
        assert done[run] / total == pytest.approx(weight / sum(weights.values()), rel=0.10), done
