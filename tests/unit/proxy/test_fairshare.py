"""The fair-share queue (virtual token counter): shares follow weights in tokens, a burst cannot starve a run,
a lone run never waits, and a client that leaves while queued gives its place back. Admission is per replica: no
replica holds more than its window, and none with room idles while a request it could serve waits."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_proxy.runs.fairshare import FairShare, Ticket, estimate_tokens, prompt_tokens

ONE = (lambda: ["r"], lambda room: room[0])  # one replica: the window is the fleet's


async def serve(fair: FairShare, demands: dict[str, tuple[float, int, int]], slots: int,
                replicas: list[str] | None = None) -> dict[str, int]:
    """Runs flood `fair` (run -> (weight, requests, tokens each)) on `replicas` (one by default; the first with room
    is chosen); the first `slots` admitted requests of the contended phase are counted (tokens per run): the share
    each run got while all of them had work waiting."""
    urls = replicas or ["r"]
    served: dict[str, int] = dict.fromkeys(demands, 0)
    order: list[str] = []
    gate = asyncio.Event()

    async def one(run: str, weight: float, tokens: int) -> None:
        ticket, _ = await fair.enter(run, weight, tokens, lambda: urls, lambda room: room[0])
        order.append(run)
        await gate.wait()
        await asyncio.sleep(0)
        fair.leave(ticket, tokens)

    tasks = [asyncio.ensure_future(one(run, weight, tokens))
             for run, (weight, count, tokens) in demands.items() for _ in range(count)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks)
    for run in order[fair.window() * len(urls):][:slots]:  # after the windows the first comers filled
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
    ticket, waited = await fair.enter("a", 1.0, 10, *ONE)
    assert waited < 0.01 and fair.inflight == 1 and ticket.replica == "r"
    fair.leave(ticket, 4)
    for _ in range(5):
        ticket, _ = await fair.enter("a", 1.0, 10, *ONE)
        fair.leave(ticket, 10)
    assert fair.inflight == 0 and fair.waiting("a") == 0 and not fair.placed


async def test_a_client_that_leaves_while_queued_gives_its_place_back() -> None:
    fair = FairShare(lambda: 1)
    ticket, _ = await fair.enter("a", 1.0, 10, *ONE)
    queued = asyncio.ensure_future(fair.enter("b", 1.0, 10, *ONE))
    await asyncio.sleep(0)
    assert fair.waiting("b") == 1
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert fair.waiting("b") == 0
    fair.leave(ticket, 10)
    assert fair.inflight == 0 and not fair.placed


def test_estimates_count_prompt_tokens_and_the_tokens_a_request_may_generate() -> None:
    assert prompt_tokens({"prompt": list(range(40))}) == 40
    assert prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_tokens({"prompt": list(range(40)), "max_tokens": 8, "n": 2}, 40) == 56
    assert estimate_tokens({"prompt": "x" * 40}, prompt_tokens({"prompt": "x" * 40})) == 10 + 16


async def test_closed_loop_clients_get_their_weighted_share_while_requests_are_in_flight() -> None:
    """Sixteen clients per run, each waiting for its answer before the next request (as rollout workers do), eight
    requests in flight on the fleet: over the first 2,000 served, requests follow the weights 1:1:2:4 within 10%.
    Counted in requests, not in a time window, and the replica's work is turns of the event loop: the same on a
    fast machine and a loaded one."""
    fair = FairShare(lambda: 8)
    weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    done = dict.fromkeys(weights, 0)
    served = 2000

    async def client(run: str) -> None:
        while sum(done.values()) < served:
            ticket, _ = await fair.enter(run, weights[run], 67, *ONE)
            for _ in range(3):  # the replica's work: other clients run meanwhile
                await asyncio.sleep(0)
            fair.leave(ticket, 64 + 3)
            done[run] += 1

    await asyncio.gather(*(client(run) for run in weights for _ in range(16)))
    total = sum(done.values())
    for run, weight in weights.items():
        assert done[run] / total == pytest.approx(weight / sum(weights.values()), rel=0.10), done


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=2, max_size=4),
       replicas=st.integers(2, 3), window=st.integers(1, 3))
def test_weighted_shares_hold_when_admission_is_per_replica(weights: list[float], replicas: int, window: int) -> None:
    slots = 40 * len(weights)
    demands = {f"r{i}": (weight, slots + 10, 10) for i, weight in enumerate(weights)}
    urls = [f"replica-{i}" for i in range(replicas)]
    served = asyncio.run(serve(FairShare(lambda: window), demands, slots, urls))
    total = sum(served.values())
    for run, (weight, _, _) in demands.items():
        expected = weight / sum(w for w, _, _ in demands.values())
        assert abs(served[run] / total - expected) <= 3 * 10 / total + 0.02, (run, served)


@settings(max_examples=80, deadline=None)
@given(replicas=st.integers(1, 3), window=st.integers(1, 3),
       runs=st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0]), st.sets(st.integers(0, 2), min_size=1)),
                     min_size=1, max_size=4),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=60))
def test_no_replica_with_room_idles_while_a_request_it_can_serve_waits(
        replicas: int, window: int, runs: list[tuple[float, set[int]]], ops: list[tuple[bool, int]]) -> None:
    """Requests of runs (each with its own candidate replicas, routed to the first with room: affinity at its most
    uneven) arrive and finish in any order; after every step no replica holds more than its window, and every
    waiting request's candidates are all full."""
    urls = [f"replica-{i}" for i in range(replicas)]
    candidates = [[urls[i] for i in sorted(chosen) if i < replicas] or urls[:1] for _, chosen in runs]

    async def scenario() -> None:
        fair = FairShare(lambda: window)
        admitted: list[Ticket] = []
        tasks = []

        async def request(index: int) -> None:
            ticket, _ = await fair.enter(f"run{index}", runs[index][0], 10, lambda: candidates[index],
                                         lambda room: room[0])
            assert ticket.replica in candidates[index]
            admitted.append(ticket)

        for arrive, pick in ops:
            if arrive:
                tasks.append(asyncio.ensure_future(request(pick % len(runs))))
            elif admitted:
                fair.leave(admitted.pop(pick % len(admitted)), 5)
            for _ in range(3):
                await asyncio.sleep(0)
            assert all(0 < held <= window for held in fair.placed.values()), fair.placed
            assert sum(fair.placed.values()) == fair.inflight == len(admitted)
            for queue in fair.queues.values():
                for ticket in queue.waiting:
                    assert all(fair.placed.get(url, 0) == window for url in ticket.candidates()), (ticket, fair.placed)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


async def test_a_full_replica_sends_the_next_request_to_one_with_room_not_to_the_queue() -> None:
    """Affinity prefers replica `a`; once `a` holds its window, the next request goes to `b` at once."""
    fair = FairShare(lambda: 2)
    prefer_a = (lambda: ["a", "b"], lambda room: "a" if "a" in room else room[0])
    tickets = [(await fair.enter(run, 1.0, 10, *prefer_a))[0] for run in ("x", "y", "x")]
    assert [ticket.replica for ticket in tickets] == ["a", "a", "b"] and fair.placed == {"a": 2, "b": 1}
    fair.leave(tickets[0], 10)
    ticket, _ = await fair.enter("y", 1.0, 10, *prefer_a)
    assert ticket.replica == "a"


async def test_a_run_whose_replicas_are_full_does_not_hold_up_another_runs_request() -> None:
    """Run `x` can only use replica `a` (full) and waits with the lowest counter; run `y`'s request can use `b`."""
    fair = FairShare(lambda: 1)
    only_a, any_replica = (lambda: ["a"], lambda room: room[0]), (lambda: ["a", "b"], lambda room: room[0])
    first, _ = await fair.enter("x", 1.0, 10, *only_a)
    queued = asyncio.ensure_future(fair.enter("x", 1.0, 10, *only_a))
    await asyncio.sleep(0)
    assert fair.waiting("x") == 1
    other, _ = await asyncio.wait_for(fair.enter("y", 1.0, 10, *any_replica), 1)
    assert other.replica == "b" and fair.waiting("x") == 1
    fair.leave(first, 10)
    second, _ = await asyncio.wait_for(queued, 1)
    assert second.replica == "a"


async def test_a_request_no_replica_can_serve_is_let_through_without_a_slot() -> None:
    fair = FairShare(lambda: 1)
    ticket, _ = await asyncio.wait_for(fair.enter("x", 1.0, 10, lambda: [], lambda room: room[0]), 1)
    assert ticket.replica is None and fair.inflight == 1 and not fair.placed
    fair.leave(ticket, None)
    assert fair.inflight == 0


async def test_a_retry_moves_the_slot_to_the_replica_that_serves_it() -> None:
    fair = FairShare(lambda: 1)
    place = (lambda: ["a", "b"], lambda room: room[0])
    ticket, _ = await fair.enter("x", 1.0, 10, *place)
    assert ticket.replica == "a"
    fair.move(ticket, "b")
    assert fair.placed == {"b": 1}
    moved_in, _ = await asyncio.wait_for(fair.enter("y", 1.0, 10, *place), 1)  # `a` has room again
    assert moved_in.replica == "a"
    fair.leave(ticket, 10)
    fair.leave(moved_in, 10)
    assert not fair.placed and fair.inflight == 0
