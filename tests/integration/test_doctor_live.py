"""`lorafleet doctor` against the real CPU fleet (issue 8): all PASS on a healthy fleet, and the right FAIL
(reason + fix, naming the replica) for each misconfiguration the issue lists.

Each class runs its own lorafleet proxy (one proxy at a time manages a shared replica). The proxies
and the doctor share one sub-folder of the session adapter root as ADAPTER_ROOT (their ledger file,
<root>/.fleet/proxy-ledger.json, is theirs alone). Extra replicas: at most two alive at once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lorafleet.adapters import lora_dir
from lorafleet.settings import StackSettings, load_settings
from lorafleet.vllm_api import VLLMClient
from lorafleet_ops.commands.doctor import CheckResult, Status, render_table, run_doctor
from lorafleet_ops.peft_adapter import write_lora_adapter
from lorafleet_ops.processes import Service, replica_service
from lorafleet_testing.process_tier import stored_at

pytestmark = pytest.mark.integration

RUN = "doctor-run"
_NUMBERS = itertools.count(1)


@pytest.fixture(scope="module")
def root(adapter_root: Path) -> Path:
    path = adapter_root / "doctor"
    (path / "runs").mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> dict:
    return json.loads((tiny_model / "config.json").read_text())


def _settings(tiny_model: Path, root: Path, proxy: Service, **overrides: object) -> StackSettings:
    """The doctor's settings: those the replicas were started with (replica_env, CPU replicas), the proxy as
    TRAINER_VLLM_URL."""
    values: dict[str, object] = {"base_model": str(tiny_model), "adapter_root": root, "run_name": RUN,
                                 "lora_rank": 8, "max_staleness": 4, "trainer_vllm_url": proxy.url,
                                 "replica_device": "cpu"}
    return load_settings(**{**values, **overrides})


# Health checks every 60 s: the first one syncs the replicas, and no reconcile undoes a state a test set up
# on purpose before the doctor looks. MIN_READY = all upstreams: healthy only once every replica is ready.
PROXY_SETTINGS = {"PROXY_HEALTH_INTERVAL_S": "60", "PROXY_LORA_LOAD_TIMEOUT_S": "3"}


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {result.name: result for result in results}


def _extra_replicas(launch_replicas, replica_env: dict[str, str], root: Path, log_dir: Path,
                    *specs: tuple[dict[str, str], list[str] | None]) -> list[Service]:
    """Start extra replicas in parallel, one per (settings overrides, command wrapper); they claim cores
    from <root>/.fleet, their own pool, so they never wait for the shared replicas' claims."""
    services = []
    for overrides, wrap in specs:
        service = replica_service(f"doctor-replica-{next(_NUMBERS)}",
                                  {**replica_env, "ADAPTER_ROOT": str(root), **overrides}, log_dir)
        service.argv = [*(wrap or []), *service.argv]
        services.append(service)
    return launch_replicas(services)


# --- a healthy fleet ------------------------------------------------------------------------------------


class TestHealthyFleet:
    @pytest.fixture(scope="class")
    def proxy(self, shared_replicas, start_proxy, root) -> Iterator[Service]:
        proxy = start_proxy(shared_replicas, root, PROXY_MIN_READY="2", **PROXY_SETTINGS)
        yield proxy
        proxy.stop()

    async def test_all_pass_mid_run(self, proxy, shared_replicas, tiny_model, root, model_config):
        """A fleet in the middle of a run: v1..v5 published and loaded, the trainer logging ratio ~1."""
        settings = _settings(tiny_model, root, proxy)
        names = [f"trl-policy-v{v}" for v in range(1, settings.max_staleness + 2)]
        paths = [write_lora_adapter(lora_dir(root, RUN) / name, model_config, str(tiny_model), seed=v)
                 for v, name in enumerate(names)]
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        # The trainer writes this file (TRL's metric names); the real one is covered by the end-to-end demo.
        (settings.run_dir / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "ratio": 1.0 + (-1) ** s * 1e-3, "reward": 0.1}) + "\n" for s in range(5)))
        async with VLLMClient(proxy.url) as client:
            for name, path in zip(names, paths, strict=True):
                await client.load_lora_adapter(name, str(path))
            try:
                results = await run_doctor(settings)
            finally:
                for name in names:
                    await client.unload_lora_adapter(name)
                (settings.run_dir / "metrics.jsonl").unlink()
        table = render_table(results)
        print(f"\n{table}")  # the doctor's table (pytest -s)
        assert all(result.status is Status.PASS for result in results), table
        checks = _by_name(results)
        assert "2 replica(s)" in checks["fleet"].reason
        assert f"v1..v{len(names)}" in checks["versions_kept"].reason
        assert "load, unload, pause, resume" in checks["broadcasts"].reason
        for replica in shared_replicas:  # the doctor left nothing behind
            async with VLLMClient(replica.url) as client:
                assert await client.is_paused() is False
                assert not any(n.startswith("lorafleet-doctor-probe") for n in await client.loaded_adapters())
        assert not [p for p in lora_dir(root, RUN).iterdir() if "probe" in p.name]

    async def test_doctors_beside_other_pausers_never_fail_a_healthy_fleet(self, proxy, shared_replicas,
                                                                            tiny_model, root):
        """Issue 56: `make doctor` while a trainer's start-up doctor probed reported `resume did not reach` on a
        healthy fleet. Two doctors probe at once while a third client pauses and resumes the fleet through the proxy
        at seeded random moments: no check fails, and nothing is left paused once the last pauser resumed."""
        settings = _settings(tiny_model, root, proxy, run_name="no-such-run")
        for seed in range(3):
            chance = random.Random(seed)
            done = asyncio.Event()

            async def pauser(client: VLLMClient, chance: random.Random = chance, done: asyncio.Event = done) -> None:
                while not done.is_set():
                    await client.pause("wait")
                    await asyncio.sleep(chance.uniform(0, 0.3))
                    await client.resume()
                    await asyncio.sleep(chance.uniform(0, 0.3))

            async def doctor(done: asyncio.Event = done) -> list[CheckResult]:
                try:
                    return await run_doctor(settings)
                finally:
                    done.set()

            async with VLLMClient(proxy.url) as client:
                results = await asyncio.gather(doctor(), run_doctor(settings), pauser(client))
                await client.resume()
            for found in results[:2]:
                table = render_table(found)
                assert not [r for r in found if r.status is Status.FAIL], f"seed {seed}\n{table}"
                assert _by_name(found)["broadcasts"].status in (Status.PASS, Status.WARN), table
            for replica in shared_replicas:
                async with VLLMClient(replica.url) as direct:
                    assert await direct.is_paused() is False, f"seed {seed}: {replica.url} left paused"

    async def test_fresh_fleet_skips_run_checks(self, proxy, tiny_model, root):
        results = _by_name(await run_doctor(_settings(tiny_model, root, proxy, run_name="no-such-run")))
        assert results["versions_kept"].status is Status.SKIP
        assert results["ratio"].status is Status.SKIP and "no run has logged" in results["ratio"].reason
        assert not [r for r in results.values() if r.status in (Status.FAIL, Status.WARN)], results

    async def test_rank_above_max_lora_rank_fails(self, proxy, tiny_model, root):
        results = _by_name(await run_doctor(_settings(tiny_model, root, proxy, lora_rank=16), probe=False))
        rank = results["lora_rank"]
        assert rank.status is Status.FAIL
        assert "adapter rank 16" in rank.reason and "--max-lora-rank 8" in rank.reason
        assert "--max-lora-rank 16" in rank.fix
        assert results["adapter_sync"].status is Status.FAIL and "--max-lora-rank 16" in results["adapter_sync"].reason

    async def test_name_rebound_to_another_path_fails(self, proxy, shared_replicas, tiny_model, root, model_config):
        settings = _settings(tiny_model, root, proxy)
        first = write_lora_adapter(root / "runs" / "rebind-a" / "doctor-rebound", model_config, str(tiny_model))
        second = write_lora_adapter(root / "runs" / "rebind-b" / "doctor-rebound", model_config, str(tiny_model),
                                    seed=7)
        odd = shared_replicas[1].url
        async with VLLMClient(proxy.url) as fleet, VLLMClient(odd) as replica:
            await fleet.load_lora_adapter("doctor-rebound", str(first))
            try:
                # A new run reusing the name, loaded behind the proxy's back on one replica.
                await replica.unload_lora_adapter("doctor-rebound")
                await replica.load_lora_adapter("doctor-rebound", str(second))
                results = _by_name(await run_doctor(settings, probe=False))
            finally:
                await fleet.unload_lora_adapter("doctor-rebound")
        names = results["names_immutable"]
        assert names.status is Status.FAIL, names
        bound = stored_at(root, first)  # the ledger binds the name to the proxy's copy of `first`
        assert f"{odd} has doctor-rebound at {second} but the ledger binds it to {bound}" in names.reason
        assert shared_replicas[0].url not in names.reason
        assert "NEW name" in names.fix


# --- misconfigured replicas ---------------------------------------------------------------------------


def _private_mount_wrapper(root: Path, empty: Path) -> list[str]:
    """Run a replica in its own mount namespace with an empty directory over <root>/runs: on one machine,
    that is a replica whose volume does not hold the adapters (needs root and util-linux `unshare`)."""
    script = f'mount --bind "{empty}" "{root / "runs"}" && exec "$0" "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def _can_unshare(scratch: Path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    (scratch / "a").mkdir(exist_ok=True)
    (scratch / "b").mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f'mount --bind "{scratch / "a"}" "{scratch / "b"}"'], capture_output=True)
    return probe.returncode == 0


def _skip_outside_ci(reason: str) -> None:
    """Skip here; fail in CI (CI=true), where a skip would turn the run green without the check."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}: CI=true, where this check must run")
    pytest.skip(reason)


class TestMisconfiguredReplicas:
    """Two extra replicas behind one proxy with a healthy shared one: one started with too few LoRA slots
    (MAX_STALENESS=0 -> --max-loras 2) that also cannot see the adapter root (private mount namespace), and
    one without LoRA (--no-enable-lora after lorafleet-replica's --enable-lora: the last flag wins)."""

    @pytest.fixture(scope="class")
    def fleet(self, shared_replicas, replica_env, start_proxy, launch_replicas, root, log_dir,
              tmp_path_factory) -> Iterator[dict[str, Service]]:
        scratch = tmp_path_factory.mktemp("doctor-ns")
        wrap = None
        if _can_unshare(scratch):
            (scratch / "empty").mkdir()
            wrap = _private_mount_wrapper(root, scratch / "empty")
        few_slots, no_lora = _extra_replicas(launch_replicas, replica_env, root, log_dir,
                                             ({"MAX_STALENESS": "0"}, wrap),
                                             ({"VLLM_EXTRA_ARGS": "--no-enable-lora"}, None))
        try:
            proxy = start_proxy([shared_replicas[0], few_slots, no_lora], root, PROXY_MIN_READY="3", **PROXY_SETTINGS)
            try:
                yield {"proxy": proxy, "good": shared_replicas[0], "few_slots": few_slots, "no_lora": no_lora,
                       **({"blind": few_slots} if wrap else {})}
            finally:
                proxy.stop()
        finally:
            few_slots.stop()
            no_lora.stop()

    @pytest.fixture(scope="class")
    async def results(self, fleet, tiny_model, root) -> dict[str, CheckResult]:
        results = await run_doctor(_settings(tiny_model, root, fleet["proxy"]))
        print(f"\n{render_table(results)}")
        return _by_name(results)

    async def test_too_few_slots_fails_naming_the_replica(self, fleet, results):
        slots = results["lora_slots"]
        assert slots.status is Status.FAIL, slots
        assert f"{fleet['few_slots'].url} has --max-loras 2" in slots.reason
        assert fleet["good"].url not in slots.reason
        assert "--max-loras 6" in slots.fix and "MAX_STALENESS=4" in slots.fix

    async def test_replica_without_lora_fails_naming_it(self, fleet, results):
        lora = results["lora_enabled"]
        assert lora.status is Status.FAIL, lora
        assert f"without --enable-lora (lora_config is null): {fleet['no_lora'].url}" in lora.reason
        assert fleet["good"].url not in lora.reason and fleet["few_slots"].url not in lora.reason
        assert "--enable-lora" in lora.fix
        # What the trainer sees through the proxy: TRL itself would fall back to merged-weight sync.
        assert results["adapter_sync"].status is Status.FAIL
        assert "without `--enable-lora`" in results["adapter_sync"].reason

    async def test_replica_that_cannot_see_the_root_fails_naming_it(self, fleet, results, root):
        if "blind" not in fleet:
            _skip_outside_ci("needs root and `unshare --mount` to hide the adapter root from one replica")
        check = results["adapter_root"]
        assert check.status is Status.FAIL, check
        assert f"{fleet['blind'].url} cannot read {root / 'runs' / RUN / '.vllm_lora'}" in check.reason
        assert "No adapter found" in check.reason
        assert fleet["good"].url not in check.reason
        assert f"ADAPTER_ROOT={root}" in check.fix and fleet["blind"].url in check.fix

    async def test_probe_leaves_nothing_behind(self, fleet, results, root):
        for name in ("good", "few_slots", "no_lora"):
            async with VLLMClient(fleet[name].url) as client:
                assert not any(n.startswith("lorafleet-doctor-probe") for n in await client.loaded_adapters())
                assert await client.is_paused() is False, name
        assert not [p for p in lora_dir(root, RUN).glob("*probe*")]

    async def test_cli_exits_non_zero_with_json(self, fleet, tiny_model, root):
        env = {**os.environ, "BASE_MODEL": str(tiny_model), "ADAPTER_ROOT": str(root), "RUN_NAME": RUN,
               "LORA_RANK": "8", "MAX_STALENESS": "4", "TRL_EXPERIMENTAL_SILENCE": "1"}
        done = subprocess.run([sys.executable, "-m", "lorafleet_ops.commands.cli", "doctor", "--url",
                               fleet["proxy"].url, "--json", "--no-probe"], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 1, done.stderr
        rows = {row["name"]: row for row in json.loads(done.stdout)}
        assert rows["lora_slots"]["status"] == "FAIL" and rows["lora_enabled"]["status"] == "FAIL"
        assert rows["adapter_root"]["status"] == "SKIP" and rows["broadcasts"]["status"] == "SKIP"
