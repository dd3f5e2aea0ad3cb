"""The fleet controller's invariants under random sequences of operations and faults (issues 11 and 24).

A hypothesis state machine drives three fault-injecting fake replicas (real HTTP, vLLM's exact bodies)
behind the real proxy app, shared by three runs (the default run and runs `a` and `b` under
`/runs/<run>/`, all publishing the same TRL names with their own weights): loads, rebinds (same name and
path, new content), unloads, pauses, resumes and completions of every run, a fourth run asking for slots
the budget may not have, mixed with replica kills, restarts, hangs, malformed answers, lagging volumes,
proxy restarts and a corrupted ledger file. After every step it waits until the fleet has settled
(every answering replica ready, every misbehaving one out of traffic) and checks the invariants of
DESIGN "Invariants of the fleet controller" and of "Several runs on one fleet":
1. every ready replica holds exactly the ledger (names, paths, content fingerprints) and its pause state;
2. a completion naming an adapter was answered by a replica holding that run's adapter, current content;
3. the ledger on disk equals the ledger in memory (and the model of what clients were told);
5. ready replicas agree on the pause state, which only clients (of the default run) change;
6. the supervision loop is alive;
and: each run sees exactly its own adapters (its /v1/models), no replica holds more adapters than its
slots, a named run's pause is held at the proxy (no replica pauses) and never stalls another run.

Bounded by default (`make test`); LORAFLEET_FUZZ_EXAMPLES=200 LORAFLEET_FUZZ_STEPS=40 runs a long profile.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lorafleet.ledger_format import fingerprint, ledger_path
from lorafleet.ports import free_port
from lorafleet.runs import DEFAULT_RUN, qualify, run_of
from lorafleet.settings import load_settings
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import FakeReplica, Running, start_server, weights_file

EXAMPLES = int(os.environ.get("LORAFLEET_FUZZ_EXAMPLES", "16"))
STEPS = int(os.environ.get("LORAFLEET_FUZZ_STEPS", "16"))
LONG = "LORAFLEET_FUZZ_EXAMPLES" in os.environ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(7200 if LONG else 300)]
NAMES = ("trl-policy-v1", "trl-policy-v2", "trl-policy-v3")
RUNS = (DEFAULT_RUN, "a", "b")
EXTRA_RUN = "c"  # only ever asks for slots: admitted while the budget has room, else refused
FAST = {"proxy_health_interval_s": 0.05, "proxy_eject_after": 2, "proxy_lora_load_timeout_s": 5.0,
        "proxy_health_timeout_s": 0.3, "proxy_eject_slow_after_s": 0.3, "proxy_sync_backoff_max_s": 0.2,
        "proxy_request_timeout_s": 5.0, "max_staleness": 1}
RUN_SLOTS = 3  # max_staleness 1 + 2: each run holds at most the three names
SLOTS = 9  # the fakes' --max-loras: three runs fit, a fourth does not
SETTLE_S = 8.0
T = TypeVar("T")


class Loop:
    """An event loop in a thread hosting the fakes and the proxy; the (synchronous) machine drives it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.io = Loop()
        self.root = Path(self._tmp())
        self.fakes = [FakeReplica(max_loras=SLOTS) for _ in range(3)]
        self.ports = [free_port() for _ in self.fakes]
        self.servers: list[Running | None] = [None, None, None]
        self.proxy: Running | None = None
        self.proxy_port = free_port()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.proxy_port}", timeout=30)
        self.ledger: dict[str, str] = {}  # fleet-unique name -> fingerprint the clients were acknowledged
        self.paused: str | None = None  # the fleet's (the default run's) pause
        self.run_paused: dict[str, str | None] = dict.fromkeys(RUNS[1:])  # named runs' pauses, held at the proxy
        self.registered: dict[str, int] = {}  # runs registered with the proxy -> the slots they reserve
        # PROXY_SYNC_PAUSE=elide (the default): a keep pause on the fleet port, as TRL sends around every sync,
        # pauses no replica and its resume is answered likewise; the proxy remembers it in memory only, per run.
        self.elided_pending: set[str] = set()
        self.content = 0

    @staticmethod
    def _tmp() -> str:
        import tempfile

        return tempfile.mkdtemp(prefix="fleet-machine-")

    # --- plumbing ----------------------------------------------------------------------------------
    def start_fake(self, index: int) -> None:
        fake = self.fakes[index]
        server = self.io.run(start_server(fake.app(), self.ports[index]))
        fake.url = server.url
        self.servers[index] = server

    def start_proxy(self) -> None:
        urls = ",".join(f"http://127.0.0.1:{port}" for port in self.ports)
        config = load_settings(proxy_upstreams=urls, adapter_root=str(self.root), **FAST)
        self.app = create_app(config)
        self.proxy = self.io.run(start_server(self.app, self.proxy_port))

    def stop_proxy(self) -> None:
        assert self.proxy is not None
        self.io.run(self.proxy.stop())
        self.proxy = None

    def alive(self, index: int) -> bool:
        return self.servers[index] is not None

    def serving(self, index: int) -> bool:
        """Should be ready once settled: alive and answering properly."""
        faults = self.fakes[index].faults
        return self.alive(index) and not faults.hung and not faults.malformed_models

    def adapter(self, qualified: str) -> Path:
        run, name = run_of(qualified)
        return self.root / "runs" / run / ".vllm_lora" / name

    def url(self, run: str, path: str) -> str:
        return path if run == DEFAULT_RUN else f"/runs/{run}{path}"

    def publish(self, qualified: str) -> str:
        """Write (new) content for a run's name at its fixed path, as a trainer that republishes would."""
        self.content += 1
        directory = self.adapter(qualified)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps({"r": 1}))
        (directory / "adapter_model.safetensors").write_bytes(weights_file(f"weights {self.content}".encode()))
        return fingerprint(directory)

    def fleet(self) -> dict[str, Any]:
        return self.http.get("/fleet").json()

    def any_serving(self) -> bool:
        return any(self.serving(i) for i in range(3))

    # --- setup -------------------------------------------------------------------------------------
    @initialize()
    def boot(self) -> None:
        for index in range(3):
            self.start_fake(index)
        self.start_proxy()
        self.settle()

    def teardown(self) -> None:
        try:
            self.http.close()
            for fake in self.fakes:
                fake.faults.hung = False
            if self.proxy is not None:
                self.stop_proxy()
            for server in self.servers:
                if server is not None:
                    self.io.run(server.stop())
        finally:
            self.io.close()

    # --- client rules ------------------------------------------------------------------------------
    def reserved(self) -> dict[str, int]:
        """Slots each run holds: registered runs, and runs holding adapters (the proxy's MAX_STALENESS + 2)."""
        return {run_of(name)[0]: RUN_SLOTS for name in self.ledger} | self.registered

    def fits(self, run: str) -> bool:
        """Whether the budget admits `run` at a load or pause: admitted already, the default run alone, or its
        slots fit beside those of the runs holding some."""
        reserved = self.reserved()
        if run in reserved or (run == DEFAULT_RUN and not reserved):
            return True
        return sum(reserved.values()) + RUN_SLOTS <= SLOTS

    def admitted(self, run: str, response: httpx.Response) -> bool:
        """True when the proxy admitted the run (the call went through); a refusal must be the budget's 409."""
        if not self.fits(run):
            assert response.status_code == 409, response.text
            assert "slot budget is 9" in response.json()["error"]["message"], response.text
            return False
        if run != DEFAULT_RUN:
            self.registered.setdefault(run, RUN_SLOTS)
        return True

    @precondition(lambda self: self.any_serving())
    @rule(run=st.sampled_from(RUNS), name=st.sampled_from(NAMES), lag=st.integers(0, 2))
    def load(self, run: str, name: str, lag: int) -> None:
        qualified = qualify(run, name)
        digest = fingerprint(self.adapter(qualified)) if qualified in self.ledger else self.publish(qualified)
        for fake in self.fakes:
            fake.faults.not_found_loads = lag  # a volume that catches up after `lag` tries
        response = self.http.post(self.url(run, "/v1/load_lora_adapter"),
                                  json={"lora_name": name, "lora_path": str(self.adapter(qualified))})
        for fake in self.fakes:
            fake.faults.not_found_loads = 0
        if self.admitted(run, response):
            assert response.status_code == 200, response.text
            assert response.text == f"Success: LoRA adapter '{name}' added successfully.", response.text
            self.ledger[qualified] = digest

    @precondition(lambda self: self.any_serving() and self.ledger)
    @rule(data=st.data())
    def rebind(self, data: st.DataObject) -> None:
        qualified = data.draw(st.sampled_from(sorted(self.ledger)))
        run, name = run_of(qualified)
        digest = self.publish(qualified)  # same name, same path, new weights (a trainer that crashed after publishing)
        response = self.http.post(self.url(run, "/v1/load_lora_adapter"),
                                  json={"lora_name": name, "lora_path": str(self.adapter(qualified))})
        assert response.status_code == 200, response.text
        self.ledger[qualified] = digest

    @precondition(lambda self: self.any_serving())
    @rule(run=st.sampled_from(RUNS), name=st.sampled_from(NAMES))
    def unload(self, run: str, name: str) -> None:
        qualified = qualify(run, name)
        response = self.http.post(self.url(run, "/v1/unload_lora_adapter"), json={"lora_name": name})
        expected = 200 if qualified in self.ledger else 404
        assert response.status_code == expected, response.text
        self.ledger.pop(qualified, None)

    @precondition(lambda self: self.any_serving())
    @rule(run=st.sampled_from(RUNS), mode=st.sampled_from(("keep", "abort", "wait")))
    def pause(self, run: str, mode: str) -> None:
        response = self.http.post(self.url(run, "/pause"), params={"mode": mode})
        if mode == "keep":  # elided for every run on the fleet port: no replica pauses, nothing is held
            assert response.status_code == 200, response.text
            self.elided_pending.add(run)
            return
        self.elided_pending.discard(run)
        if run == DEFAULT_RUN:  # the fleet's pause: broadcast to the replicas, as on a single-run fleet
            assert response.status_code == 200, response.text
            self.paused = mode
        elif self.admitted(run, response):  # held at the proxy; the run is admitted at its first pause
            assert response.status_code == 200, response.text
            self.run_paused[run] = mode

    @precondition(lambda self: self.any_serving())
    @rule(run=st.sampled_from(RUNS))
    def resume(self, run: str) -> None:
        response = self.http.post(self.url(run, "/resume"))
        assert response.status_code == 200, response.text
        if run in self.elided_pending:
            self.elided_pending.discard(run)
        elif run == DEFAULT_RUN:
            self.paused = None
        else:
            self.run_paused[run] = None

    @precondition(lambda self: self.any_serving())
    @rule(max_staleness=st.integers(0, 2))
    def register_another_run(self, max_staleness: int) -> None:
        """A fourth run asks for slots: admitted only while the reservations of the runs holding some leave room."""
        response = self.http.post(self.url(EXTRA_RUN, "/register"), json={"max_staleness": max_staleness})
        others = sum(slots for run, slots in self.reserved().items() if run != EXTRA_RUN)
        if others + max_staleness + 2 <= SLOTS:
            assert response.status_code == 200, response.text
            self.registered[EXTRA_RUN] = max_staleness + 2
        else:
            assert response.status_code == 409, response.text
            assert "slot budget is 9" in response.json()["error"]["message"]

    @precondition(lambda self: self.any_serving() and self.paused is None)
    @rule(data=st.data(), seed=st.integers(0, 50))
    def completion(self, data: st.DataObject, seed: int) -> None:
        run = data.draw(st.sampled_from([run for run in RUNS if self.run_paused.get(run) is None]))
        names = [run_of(name)[1] for name in sorted(self.ledger) if run_of(name)[0] == run]
        model = data.draw(st.sampled_from(["fake-base", *names]))
        response = self.http.post(self.url(run, "/v1/completions"),
                                  json={"model": model, "prompt": list(range(seed, seed + 40)), "max_tokens": 3})
        others = [other for other, mode in self.run_paused.items() if mode is not None]
        assert response.status_code == 200, f"{response.text} (runs paused: {others})"
        answer = response.json()
        holder = next(fake for fake in self.fakes if fake.url == answer["served_by"])
        if model != "fake-base":  # invariant 2: answered by a replica holding this run's adapter, current content
            qualified = qualify(run, model)
            assert answer["model"] == model, "the answer names the fleet-unique name, not the run's own"
            assert qualified in holder.adapters, f"{qualified} answered by {holder.url}, which lacks it"
            assert answer["served_fingerprint"] == self.ledger[qualified], f"{qualified} served with stale weights"

    # --- fault rules -------------------------------------------------------------------------------
    @precondition(lambda self: sum(self.serving(i) for i in range(3)) >= 2)
    @rule(index=st.integers(0, 2))
    def kill(self, index: int) -> None:
        server = self.servers[index]
        if server is not None:
            self.fakes[index].faults.hung = False
            self.io.run(server.stop())
            self.servers[index] = None

    @rule(index=st.integers(0, 2))
    def restart(self, index: int) -> None:
        if self.servers[index] is not None:
            self.io.run(self.servers[index].stop())  # type: ignore[union-attr]
        self.fakes[index].restart()
        self.fakes[index].faults.hung = self.fakes[index].faults.malformed_models = False
        self.start_fake(index)

    @precondition(lambda self: sum(self.serving(i) for i in range(3)) >= 2)
    @rule(index=st.integers(0, 2), malformed=st.booleans())
    def misbehave(self, index: int, malformed: bool) -> None:
        if malformed:
            self.fakes[index].faults.malformed_models = True
        else:
            self.fakes[index].faults.hung = True

    @rule(index=st.integers(0, 2))
    def heal(self, index: int) -> None:
        self.fakes[index].faults.hung = self.fakes[index].faults.malformed_models = False

    # A replica out of traffic while a name is rebound, then back after a proxy restart, is trusted to hold the
    # ledger's content (a new proxy cannot know what it loaded): see docs/concepts/fleet-state.md. So the proxy
    # restarts only while no replica is hung or malformed.
    @precondition(lambda self: all(self.serving(i) or not self.alive(i) for i in range(3)))
    @rule(corrupt=st.booleans())
    def restart_proxy(self, corrupt: bool) -> None:
        self.stop_proxy()
        self.elided_pending.clear()  # a new proxy process has no elided pause pending
        if corrupt:
            ledger_path(self.root).parent.mkdir(parents=True, exist_ok=True)
            ledger_path(self.root).write_text('{"version": 2, "adapters": [{"na')
            if self.paused is not None:
                self.paused = "keep"  # a rebuilt ledger knows the fleet is paused, not how
            # ... nor the runs' registrations and pauses (runs holding adapters keep their slots by default)
            self.run_paused = dict.fromkeys(RUNS[1:])
            self.registered.clear()
        self.start_proxy()

    # --- invariants --------------------------------------------------------------------------------
    def settle(self) -> dict[str, Any]:
        """Wait for two health rounds (so the proxy has looked at the fleet since the last step), then until every
        serving replica is ready and every other one is out of traffic."""
        deadline = time.monotonic() + SETTLE_S
        fleet = self.app.state.fleet
        rounds, seen = 0, fleet.heartbeat
        while rounds < 2 and time.monotonic() < deadline:
            if fleet.heartbeat != seen:
                rounds, seen = rounds + 1, fleet.heartbeat
            time.sleep(0.01)
        while True:
            view = self.fleet()
            states = {r["url"]: r["state"] for r in view["replicas"]}
            want = {f"http://127.0.0.1:{port}": self.serving(i) for i, port in enumerate(self.ports)}
            if all((states[url] == "ready") == ok for url, ok in want.items()) and not view["ledger_rebuilding"]:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"the fleet never settled: states={states} expected ready={want} "
                                     f"errors={[r['last_error'] for r in view['replicas']]}")
            time.sleep(0.05)

    @invariant()
    def fleet_matches_the_ledger(self) -> None:
        if self.proxy is None:
            return
        view = self.settle()
        assert view["loops_alive"], "the supervision loop died"
        ledger = {entry["name"]: entry for entry in view["ledger"]}
        assert {name: entry["fingerprint"] for name, entry in ledger.items()} == self.ledger
        assert (view["paused"] is None) == (self.paused is None)
        on_disk = json.loads(ledger_path(self.root).read_text()) if ledger_path(self.root).exists() else None
        if on_disk is not None or ledger:
            assert on_disk is not None and on_disk["adapters"] == view["ledger"], "ledger on disk != memory"
            assert on_disk["paused"] == view["paused"]
        for index, fake in enumerate(self.fakes):
            assert len(fake.adapters) <= fake.max_loras, f"{fake.url} holds more adapters than its slots"
            if not self.serving(index):
                continue
            assert fake.adapters == {name: entry["path"] for name, entry in ledger.items()}, fake.url
            assert fake.fingerprints == {name: entry["fingerprint"] for name, entry in ledger.items()}, fake.url
            assert (fake.paused is not None) == (self.paused is not None), f"{fake.url} pause state differs"
        runs = {row["run"]: row for row in view["runs"]}
        for run in RUNS:
            own = sorted(run_of(name)[1] for name in self.ledger if run_of(name)[0] == run)
            models = self.http.get(self.url(run, "/v1/models")).json()["data"]
            assert sorted(card["id"] for card in models[1:]) == own, f"run {run} sees other adapters than its own"
            if run != DEFAULT_RUN:
                paused = runs[run]["paused"] if run in runs else None
                assert paused == self.run_paused[run], f"run {run}: pause {paused} != {self.run_paused[run]}"


# No shrinking in the bounded profile (a shrink replays whole fleets for minutes); the long profile shrinks.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if LONG else [])
FleetMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                          suppress_health_check=list(HealthCheck), phases=PHASES)
test_fleet_controller_invariants = FleetMachine.TestCase
