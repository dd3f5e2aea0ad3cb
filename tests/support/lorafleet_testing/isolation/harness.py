"""One isolation attack: victims with their own adapters, the real proxy (in this process, real HTTP, run keys) in
front of real replicas, the adversary's seeded schedule, observations of every replica, then the checker.

The proxy runs in the harness's process so that a planted defect (plants.py, LORAFLEET_PLANT) is a monkeypatch of the
product here, and so the adversary's racing threads compete with the proxy's copy for the same cores, as a trainer
on the proxy's host would. Every artifact the checker reads is written under `out`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from lorafleet.adapters import adapter_dir, content_dir, run_dir
from lorafleet.ledger_format import fingerprint, ledger_path
from lorafleet.run_key_store import provision
from lorafleet.runs import qualify
from lorafleet.settings import load_settings
from lorafleet_ops.tiny_model import make_adapter
from lorafleet_proxy.app import create_app

from lorafleet_testing.fakes import start_server
from lorafleet_testing.isolation.adversary import SAME_CONTENT, Tenant, attempt, digests, observe, schedule
from lorafleet_testing.isolation.checker import check
from lorafleet_testing.isolation.plants import put_back
from lorafleet_testing.isolation.tricks import VICTIM_VERSION, Scene
from lorafleet_testing.waiting import until

# carol publishes the adversary's own bytes; each run registers max_staleness 0 (2 slots): 6, the shared replicas'
# --max-loras, hold the three
ADVERSARY, VICTIMS, TWIN = "mallory", ("alice",), "carol"
MAX_MB = 8  # the harness proxy's PROXY_ADAPTER_MAX_MB: a sparse file past it is cheap to make
VICTIM_EVERY = 20  # a victim loads again (and every replica is observed) every this many attempts


@dataclass(frozen=True)
class Attack:
    seed: int
    attempts: int | None = None  # stop after this many (None: when `minutes` ran out)
    minutes: float = 2.0
    plant: str | None = None


async def attack(replicas: list[str], root: Path, model: Path, out: Path, plan: Attack) -> dict[str, Any]:
    """Run `plan` against `replicas` with ADAPTER_ROOT `root` (fresh); artifacts and the verdict under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tenants = {run: Tenant(run, provision(out / "keys", run)) for run in (ADVERSARY, *VICTIMS, TWIN)}
    scene, twin_path = _publish(root, model, out)
    undo = put_back(plan.plant)
    app = create_app(load_settings(proxy_upstreams=",".join(replicas), adapter_root=str(root),
                                   run_keys_dir=str(out / "keys"), proxy_adapter_max_mb=MAX_MB,
                                   proxy_health_interval_s=0.5, proxy_lora_load_timeout_s=20,
                                   proxy_canary_interval_s=0, proxy_content_grace_s=30))
    server = await start_server(app)
    # A fresh connection per request: a kept-alive one the server closed would read as a failure of the proxy.
    http = httpx.AsyncClient(base_url=server.url, timeout=180, limits=httpx.Limits(max_keepalive_connections=0))
    try:
        await until(lambda: _ready(http), "every replica ready", 180)
        for tenant in tenants.values():
            registered = await http.post(f"/runs/{tenant.run}/register", headers=tenant.headers(),
                                         json={"max_staleness": 0, "weight": 1})
            assert registered.status_code == 200, registered.text
        for run in VICTIMS:
            await _victim_load(http, tenants[run], 0, out)
        await _record(out / "observations.jsonl", await observe(replicas, 0))
        started, done = time.monotonic(), 0
        for number, trick, rng in schedule(plan.seed):
            if (plan.attempts is not None and done >= plan.attempts) or (
                    plan.attempts is None and time.monotonic() - started > plan.minutes * 60):
                break
            rival = (tenants[TWIN], "shared-v1", twin_path) if trick == SAME_CONTENT else None
            record = await attempt(http, tenants[ADVERSARY], scene, number, trick, rng, rival)
            await _record(out / "attempts.jsonl", [record])
            done += "skipped" not in record
            if 200 <= record.get("status", 0) < 300:
                await _record(out / "observations.jsonl", await observe(replicas, number))
                await tenants[ADVERSARY].unload(http, record["name"])
            if number % VICTIM_EVERY == 0:
                await _victim_load(http, tenants[VICTIMS[number // VICTIM_EVERY % len(VICTIMS)]], number, out)
                await _record(out / "observations.jsonl", await observe(replicas, number))
        ledger = ledger_path(root)
        shutil.copyfile(ledger, out / "ledger.json")
        for entry in (await http.get("/fleet")).json()["ledger"]:
            await http.post("/v1/unload_lora_adapter", json={"lora_name": entry["name"]})
        seconds = round(time.monotonic() - started, 1)
    finally:
        await http.aclose()
        await server.stop()
        undo()
    verdict = check(out)
    return {"seed": plan.seed, "plant": plan.plant, "seconds": seconds, **verdict}


def _publish(root: Path, model: Path, out: Path) -> tuple[Scene, str]:
    """The victims' published versions, the adversary's own adapter, carol's copy of it; victims.json."""
    template = make_adapter(run_dir(root, ADVERSARY) / "template", model, seed=640)
    victims = {run: make_adapter(adapter_dir(root, run, VICTIM_VERSION), model, seed=641 + n)
               for n, run in enumerate(VICTIMS)}
    twin = adapter_dir(root, TWIN, "shared-v1")
    shutil.copytree(template, twin)
    (out / "victims.json").write_text(json.dumps({
        "adversary": ADVERSARY, "adversary_files": digests(template),
        "victims": {run: {"name": qualify(run, VICTIM_VERSION), "fingerprint": fingerprint(folder),
                          "files": digests(folder)} for run, folder in victims.items()}}, indent=1))
    scene = Scene(root, ADVERSARY, template, victims, MAX_MB << 20, content_dir(root))
    return scene, str(twin)


async def _ready(http: httpx.AsyncClient) -> bool:
    return all(r["state"] == "ready" for r in (await http.get("/fleet")).json()["replicas"])


async def _victim_load(http: httpx.AsyncClient, tenant: Tenant, number: int, out: Path) -> None:
    path = adapter_dir(Path("."), tenant.run, VICTIM_VERSION).as_posix()
    answer = await tenant.load(http, VICTIM_VERSION, path)
    await _record(out / "victim_loads.jsonl", [{"attempt": number, "run": tenant.run, "status": answer.status_code,
                                                 "body": answer.text[:300]}])


async def _record(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def run_attack(replicas: list[str], root: Path, model: Path, out: Path, plan: Attack) -> dict[str, Any]:
    """`attack` from synchronous code (the bench script)."""
    return asyncio.run(attack(replicas, root, model, out, plan))
