"""The Compose stack end to end on a real Docker engine, driven by the user's own commands.

`make test-stack CPU=1` (cpu profile; CI runs it on a private engine, tools/engine.sh) or `make test-gpu` (NVIDIA
GPUs). Plain `pytest tests/stack` skips with one line naming what is missing; `LORAFLEET_STACK_REQUIRED=1` (the make
targets) and `CI=true` turn that into a failure. One stack per module, in a fresh copy of the project with `.env` made
from `.env.example` and the two keys (lorafleet_testing.stack_plan, .stack_driver), and the guide's commands in order:
  1. `make up`: every replica `ready`, each having generated (the proxy's warm-up), each on its own device;
     gpu: the GPUs the replicas' processes hold (host nvidia-smi) are distinct and not the trainer's;
  2. `make status` and `make doctor` against it (the doctor PASSes, its failures would name the replica);
  3. the boundary on real networks: keys on the public port (127.0.0.1 only), the fleet port unreachable from the
     host and reachable from the trainer, replicas unreachable from the trainer, internal networks, non-root proxy;
     the content store written by the proxy alone, read-only to replicas (which see no run's folder), invisible to
     trainers, and a load naming it (or any path outside the run's folder) refused;
  4. the trainer `make up` started trains: every published version served by every replica (their own word),
     importance ratio within the doctor's bounds, adapters and checkpoints written to the store;
  5. the same greedy request gives identical tokens and logprobs on every replica;
  6. a second run (`make train RUN=b`, its own key) trains with the first; each trainer sees only its own run's
     directory: b can neither read the first run's adapters and checkpoints nor write into its directory, and the
     store's models are read-only to it; the proxy's main process killed, then the
     proxy stopped for a minute and started: both trainers wait and train on (not restarted, every step once, in
     order), the ledger and every replica agree, and how soon the fleet serves again is measured; run b is parked;
  7. `docker compose stop` of the trainer: checkpoint, exit 0, not restarted; `start` resumes from the checkpoint;
     then stopped again (a parked run: its adapters stay served, and the CPU goes to the fleet's own steps);
     then given a few more steps and `docker kill`ed twice (after a step; as a checkpoint appears), brought back with
     `docker compose start`, it finishes, and the chaos checker finds its run folder lossless;
  8. `make scale` up by one under traffic: the new replica holds every adapter before it gets traffic, no failure;
  9. a replica's main process killed under traffic: no client-visible failure, Docker restarts it, the proxy re-syncs
     it before it takes traffic again;
  10. a replica frozen (`docker pause`) under traffic: it leaves routing, no client-visible failure, and unpaused it
     re-syncs and takes traffic again;
  11. `make down` leaves volumes only, `down -v` nothing.
The stack is always removed with `down -v`; when a test fails, every container's state and logs are saved under
results/stack/ at once.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from lorafleet.adapters import LORA_DIR_NAME, fleet_dir, metrics_path
from lorafleet.ledger_format import LEDGER_FILE
from lorafleet.ratio_outliers import RATIO_FAIL
from lorafleet.settings import CommonSettings, StackSettings
from lorafleet_testing import stack_plan
from lorafleet_testing.chaos.judge import RunSpec, check_run
from lorafleet_testing.stack_driver import (
    REPO,
    Stack,
    StackSession,
    checked,
    copy_project,
    detect_gpus,
    host_nvidia_smi,
    missing_requirements,
)
from lorafleet_testing.stack_plan import RUN_NAME, Profile, StackPlan, ledger, metric_rows, url_host
from lorafleet_testing.traffic import Traffic as CompletionTraffic
from lorafleet_trainer.checkpoints import WRITING_MARKER
from lorafleet_trainer.prompt_log import PROMPTS_FILE, effective
from lorafleet_trainer.recipes import TINY_PROMPTS

pytestmark = [pytest.mark.stack, pytest.mark.timeout(3600)]

PROFILE: Profile = "cpu" if os.environ.get("LORAFLEET_STACK_PROFILE") == "cpu" else "gpu"
REPLICAS = int(os.environ.get("LORAFLEET_STACK_REPLICAS", "2"))
WAIT_S = int(os.environ.get("LORAFLEET_STACK_WAIT_S", "1800" if PROFILE == "gpu" else "900"))
ARTIFACTS = REPO / "results" / "stack"
ADAPTER_ROOT = Path(StackSettings.model_fields["adapter_root"].default)  # the stack's ADAPTER_ROOT: the default
PROMPT = "<|im_start|>user\nWhat is 17 + 25? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
# Same weights, same kernels, one request at a time: greedy decoding agrees exactly; the tolerance only absorbs
# the last bits of bf16 reductions on GPUs of one model.
LOGPROB_ABS = 1e-5 if PROFILE == "cpu" else 1e-3
SECOND_RUN = "b"  # `make train RUN=b`, docs/guides/runs.md's second run
OUTAGE_S = 60.0  # the proxy stopped at least this long under training
# ... and until each trainer has met the outage and logged its wait: a trainer busy with a step on the rollouts it
# already had needs the fleet only at its next sync. Well under TRAINER_FLEET_WAIT_S (600 s), when it would give up.
MET_OUTAGE_S = 300.0
FLEET_WAIT_LINE = "waiting for the fleet"  # in the rollouts' retries and the control calls' (control_call_waiting)
# Steps the parked run is given for the trainer-kill test: one before the first kill, up to SAVE_STEPS (3) until the
# checkpoint the second kill meets, and a last start that trains to MAX_STEPS.
KILLED_RUN_STEPS = 6

T = TypeVar("T")

# Run inside containers (replicas are not published; the trainer's network is the one to test from). A replica's
# /v1 routes want vLLM's key, which its container has as PROXY_UPSTREAM_TOKEN.
REPLICA_CALL = """
import os, sys, urllib.request
url = "http://127.0.0.1:%s%s" % (os.environ.get("REPLICA_PORT", "8000"), sys.argv[1])
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["PROXY_UPSTREAM_TOKEN"]}
body = sys.argv[2].encode() if len(sys.argv) > 2 else None
print(urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=300).read().decode())
"""
# A load as a trainer sends it, from inside its container, to its own TRAINER_VLLM_URL: prints the status and the body.
LOAD = """
import json, os, sys, urllib.error, urllib.request
body = json.dumps({"lora_name": sys.argv[1], "lora_path": sys.argv[2]}).encode()
url = os.environ["TRAINER_VLLM_URL"].rstrip("/") + "/v1/load_lora_adapter"
request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
try:
    answer = urllib.request.urlopen(request, timeout=300)
    print(answer.status, answer.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode())
"""
CONTENT_MARKER = "stack-test-marker"  # not named like a fingerprint's hex: the store's garbage collection leaves it
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("open")
except OSError as exc:
    print("closed: %s" % exc)
"""


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = missing_requirements(PROFILE, REPLICAS)
    required = os.environ.get("LORAFLEET_STACK_REQUIRED") == "1" or os.environ.get("CI") == "true"
    if reason and required:  # make test-stack / make test-gpu, and CI, where a skip would hide the tier
        pytest.fail(reason, pytrace=False)
    if reason:
        pytest.skip(reason)
    plan = stack_plan.plan_stack(PROFILE, replicas=REPLICAS, gpus=detect_gpus() if PROFILE == "gpu" else None,
                                 cores=os.cpu_count(), model=os.environ.get("LORAFLEET_STACK_MODEL") or None)
    stack = Stack(plan, copy_project(tmp_path_factory.mktemp("project") / "lorafleet"))
    session = StackSession(stack, ARTIFACTS, wait_timeout_s=WAIT_S)
    started = time.monotonic()
    session.start()  # tears down (and saves logs) itself when `make up` fails
    print(f"\n`make up{' CPU=1' if PROFILE == 'cpu' else ''}` took {time.monotonic() - started:.0f}s")
    try:
        yield stack
    finally:
        session.stop()


@pytest.fixture(autouse=True)
def logs_when_failed(request: pytest.FixtureRequest, stack: Stack) -> Iterator[None]:
    """A failed test's evidence, saved before the next test changes it (the last one removes every container)."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(f"\nlogs of every container saved to {stack.save_logs(ARTIFACTS, request.node.name)}")


# --- helpers ----------------------------------------------------------------------------------------------------


def public(plan: StackPlan, path: str, key: str | None, body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}".strip()}  # "": a bare "Bearer"
    if body is None:
        return httpx.get(plan.public_url + path, headers=headers, timeout=30)
    return httpx.post(plan.public_url + path, headers=headers, json=body, timeout=300)


def fleet(stack: Stack) -> dict[str, Any]:
    response = public(stack.plan, "/fleet", stack.plan.api_key)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(condition: Callable[[], T], what: str, timeout_s: float, every_s: float = 2.0,
             alive: Callable[[], bool] | None = None) -> T:
    """Poll until `condition()` is truthy; fail at the deadline or as soon as `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert alive is None or alive(), f"stopped while waiting for {what}"
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def all_ready(stack: Stack, count: int) -> dict[str, Any] | None:
    """The /fleet snapshot once exactly `count` replicas are ready, have generated and hold every ledger adapter."""
    snapshot = fleet(stack)
    ready = [r for r in snapshot["replicas"] if r["state"] == "ready"]
    if len(ready) == count and all(r.get("generates") for r in ready) and not stack_plan.unsynced(snapshot):
        return snapshot
    return None


def replica_devices(stack: Stack) -> dict[str, str | None]:
    """Container -> the device its vLLM process (PID 1 after the entrypoint's exec) was started on."""
    environ = {row["Name"]: stack.docker("exec", row["ID"], "cat", "/proc/1/environ").stdout
               for row in stack.containers(stack.plan.replica_service)}
    return {name: stack_plan.device_from_environ(text, stack.plan.profile) for name, text in environ.items()}


def assert_devices_spread(stack: Stack, count: int) -> None:
    """gpu: one distinct GPU of the pool each. cpu (VLLM_CPU_SETS=auto): one core each, shared only once every
    core has a replica (counts per core differ by at most one)."""
    devices = replica_devices(stack)
    assert len(devices) == count, devices
    assert None not in devices.values(), f"a replica's vLLM has no claimed device: {devices}"
    if stack.plan.profile == "gpu":
        assert len(set(devices.values())) == count, f"replicas share a GPU: {devices}"
        assert set(devices.values()) <= set(stack.plan.replica_pool), f"outside the pool: {devices}"
        return
    per_core = Counter(devices.values())
    assert set(per_core) <= set(stack.plan.replica_pool), f"outside the machine's cores: {devices}"
    spread = [per_core.get(core, 0) for core in stack.plan.replica_pool]
    assert max(spread) - min(spread) <= 1, f"replicas share a core while another is free: {devices}"


def assert_gpus_held_one_each(stack: Stack) -> None:
    """What the hardware says, not the logs: host nvidia-smi's pids per GPU against `docker top`."""
    index_of = stack_plan.parse_gpu_indices(host_nvidia_smi("--query-gpu=index,uuid"))
    apps = stack_plan.parse_compute_apps(host_nvidia_smi("--query-compute-apps=pid,gpu_uuid"))
    pids = {row["Name"]: stack_plan.parse_top_pids(stack.docker("top", row["ID"], "-eo", "pid").stdout)
            for row in stack.containers(stack.plan.replica_service)}
    held = stack_plan.gpus_held(pids, apps, index_of)
    assert all(len(gpus) == 1 for gpus in held.values()), f"each replica should hold exactly one GPU: {held}"
    taken = [next(iter(gpus)) for gpus in held.values()]
    assert len(set(taken)) == len(taken), f"replicas share a GPU: {held}"
    assert set(taken) <= set(stack.plan.replica_pool), f"a replica holds a GPU outside VLLM_GPUS: {held}"
    assert not set(taken) & set(stack.plan.trainer_gpus), f"a replica holds the trainer's GPU: {held}"


def in_container(stack: Stack, container: str, script: str, *args: str) -> str:
    return stack.docker("exec", container, "python3", "-c", script, *args, timeout_s=600).stdout


def served_by(stack: Stack, container: str) -> dict[str, str]:
    """The adapters a replica itself lists (name -> path), asked inside its container."""
    cards = json.loads(in_container(stack, container, REPLICA_CALL, "/v1/models"))["data"]
    return {card["id"]: card["root"] for card in cards if card.get("parent")}


def metrics(stack: Stack, run: str = RUN_NAME) -> list[dict[str, Any]]:
    result = stack.compose("exec", "-T", "proxy", "cat", str(metrics_path(ADAPTER_ROOT, run)), check=False)
    return metric_rows(result.stdout) if result.returncode == 0 else []


def steps(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({int(row["step"]) for row in rows if "step" in row})


def trained_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The steps a run trained, one entry per training row (those with the importance ratio): a step trained twice
    (a rollout group counted again after an outage) appears twice."""
    return [int(row["step"]) for row in rows if "ratio" in row]


def last_step(stack: Stack, run: str = RUN_NAME) -> int:
    return max(steps(metrics(stack, run)), default=0)


def assert_ratio_in_bounds(rows: list[dict[str, Any]]) -> None:
    ratios = [float(row["ratio"]) for row in rows if "ratio" in row]
    assert ratios, "the run logged no importance ratio"
    outside = [r for r in ratios if abs(r - 1) > RATIO_FAIL]
    assert not outside, f"importance ratio left [{1 - RATIO_FAIL}, {1 + RATIO_FAIL}] (doctor FAIL): {ratios}"


def run_of(path: str) -> str:
    """The run an adapter belongs to, from the run folder it was published to (ADAPTER_ROOT/runs/<run>/...)."""
    return path.split("/runs/", 1)[1].split("/", 1)[0]


def every_replica_serves_the_ledger(stack: Stack, runs: tuple[str, ...] = (RUN_NAME,)) -> bool:
    """Each replica's own list (not the proxy's word) holds every ledger adapter at its path, and the ledger holds
    versions of exactly `runs`. The trainers keep publishing (a new version loaded, the oldest unloaded), so a
    comparison counts only while the ledger stayed the same across all the replicas' answers; a replica that never
    catches up fails at the caller's deadline."""
    snapshot = all_ready(stack, stack.plan.replicas)
    if snapshot is None:
        return False
    live = ledger(snapshot)
    # A ledger entry's path is its content-store folder; `source` the run folder it was published to.
    sources = [entry.get("source") or entry["path"] for entry in snapshot["ledger"]]
    assert len(live) >= 2 * len(runs) and {run_of(path) for path in sources} == set(runs), snapshot["ledger"]
    served = {row["Name"]: served_by(stack, row["ID"]) for row in stack.containers(stack.plan.replica_service)}
    if ledger(fleet(stack)) != live:
        return False  # a publish happened meanwhile: ask again
    missing = {name: {n: p for n, p in live.items() if held.get(n) != p} for name, held in served.items()}
    if any(missing.values()):
        print(f"replicas lacking ledger adapters (ledger {sorted(live)}): {missing}")
        return False
    return True


def wait_back_in_traffic(stack: Stack, host: str, count: int, what: str) -> None:
    """Wait until the replica at `host` is ready and synced among `count` ready replicas, then routed to again."""

    def back() -> dict[str, Any] | None:
        snapshot = all_ready(stack, count)  # ready only once synced and generating
        return next((r for r in (snapshot or {}).get("replicas", []) if url_host(r["url"]) == host), None)

    routed = wait_for(back, f"{what} ready and synced", 900)["routed"]
    wait_for(lambda: (back() or {}).get("routed", 0) > routed, f"traffic on {what}", 600, every_s=0.5)


def trainer(stack: Stack) -> dict[str, Any]:
    """The stack's own trainer container (not a `make train RUN=...` one-off of the same service)."""
    (row,) = [row for row in stack.containers(stack.plan.trainer_service, all_states=True)
              if "com.docker.compose.oneoff=True" not in row.get("Labels", "")]
    return stack.inspect(row["ID"])


def trainer_running(stack: Stack) -> bool:
    return bool(trainer(stack)["State"]["Running"])


def base_model(stack: Stack) -> str:
    return str(public(stack.plan, "/v1/models", stack.plan.api_key).json()["data"][0]["id"])


class Traffic(CompletionTraffic):
    """Completions through the public port, one at a time, in a thread: a user evaluating while the fleet changes.
    Bounded: stops at the end of the `with` or after `limit_s`. Every answer that is not 200 is kept (`failures`)."""

    def __init__(self, stack: Stack, limit_s: float = 900, every_s: float = 0.25) -> None:
        super().__init__(stack.plan.public_url, base_model(stack), PROMPT, api_key=stack.plan.api_key,
                         every_s=every_s, limit_s=limit_s, timeout_s=300)

    def wait_sent(self, count: int, timeout_s: float = 300) -> None:
        goal = self.sent + count
        wait_for(lambda: self.sent >= goal, f"{count} more completions", timeout_s, every_s=0.5)


# --- tests, in order: each builds on the stack the previous left ------------------------------------------------


def test_every_replica_is_ready_has_generated_and_has_its_own_device(stack: Stack) -> None:
    # `up --wait` returns once the proxy is healthy (one replica ready): wait for all of them.
    snapshot = wait_for(lambda: all_ready(stack, stack.plan.replicas), f"{stack.plan.replicas} ready replicas", 900)
    assert len(snapshot["replicas"]) == stack.plan.replicas, snapshot["replicas"]
    assert_devices_spread(stack, stack.plan.replicas)
    if stack.plan.profile == "gpu":
        assert_gpus_held_one_each(stack)


def test_make_status_and_make_doctor_report_the_fleet(stack: Stack) -> None:
    status = stack.make("status", timeout_s=120).stdout
    assert f"ready {stack.plan.replicas}/{stack.plan.replicas}" in status, status
    doctor = stack.make("doctor", timeout_s=600, check=False)
    report = doctor.stdout + doctor.stderr
    assert doctor.returncode == 0, report
    assert "FAIL" not in report.replace("0 FAIL", ""), report
    assert "PASS" in report, report


def test_the_boundary_holds_on_real_networks(stack: Stack) -> None:
    plan = stack.plan
    # The public port: 127.0.0.1 only, and the key on every request.
    (proxy,) = stack.containers("proxy")
    bindings = stack.inspect(proxy["ID"])["NetworkSettings"]["Ports"]
    published = {port: [b["HostIp"] for b in hosts or []] for port, hosts in bindings.items() if hosts}
    assert published == {f"{plan.public_port}/tcp": ["127.0.0.1"]}, f"published ports: {published}"
    for key in (None, plan.api_key + "-wrong", ""):
        response = public(plan, "/v1/models", key)
        assert response.status_code == 401, (key is None, response.status_code, response.text)
        assert response.json()["error"]["code"] == 401
    assert public(plan, "/v1/models", plan.api_key).status_code == 200
    # The fleet port listens on the internal fleet network alone: not on the proxy's other addresses.
    fleet_port = int(StackSettings.model_fields["proxy_port"].default)
    public_ip = stack.container_ip(proxy["ID"], "public")
    socket.create_connection((public_ip, plan.public_port), timeout=5).close()  # that address is reachable...
    with pytest.raises(ConnectionRefusedError):  # ...and nothing listens there on the fleet port
        socket.create_connection((public_ip, fleet_port), timeout=5).close()
    # From the trainer's container: the proxy's fleet port answers, a replica does not.
    (trainer_row,) = stack.containers(plan.trainer_service)
    replica_ip = stack.container_ip(stack.containers(plan.replica_service)[0]["ID"])
    assert in_container(stack, trainer_row["ID"], CONNECT, "proxy-fleet", str(fleet_port)).strip() == "open"
    reach = in_container(stack, trainer_row["ID"], CONNECT, replica_ip, "8000").strip()
    assert reach.startswith("closed"), f"the trainer reaches a replica at {replica_ip}: {reach}"
    # Replicas live on internal networks only.
    for row in stack.containers(plan.replica_service):
        networks = stack.inspect(row["ID"])["NetworkSettings"]["Networks"]
        assert set(networks) == {f"{plan.project}_replicas"}, f"{row['Name']} is on {sorted(networks)}"
    for network in ("replicas", "fleet"):
        info = json.loads(stack.docker("network", "inspect", f"{plan.project}_{network}").stdout)[0]
        assert info["Internal"] is True, f"{network} network is not internal"
    # The proxy runs as its own non-root user and writes its ledger on the fleet volume.
    user = stack.compose("exec", "-T", "proxy", "id", "-u").stdout.strip()
    assert user == "10001", user
    ledger_file = f"{fleet_dir(ADAPTER_ROOT)}/{LEDGER_FILE}"
    owner = stack.compose("exec", "-T", "proxy", "stat", "-c", "%u", ledger_file).stdout
    assert owner.strip() == "10001", owner


def test_the_content_store_is_the_proxys_to_write_replicas_read_it_and_trainers_never_see_it(stack: Stack) -> None:
    """Issue 57 on the real engine (compose.yaml's mounts): the proxy's user writes the content store
    (ADAPTER_ROOT/.content, the `content` volume); every replica reads it, writes nothing there and sees no run's
    folder; a trainer sees no content store at all, and what it writes at that path never reaches it; a load naming a
    folder of the store, or another path outside the run's folder, is refused (a 4xx with vLLM's error body) and loads
    nothing."""
    content = f"{ADAPTER_ROOT}/.content"
    marker = f"{content}/{CONTENT_MARKER}"
    (trainer_row,) = stack.containers(stack.plan.trainer_service)

    def run_in(container: str, command: str) -> subprocess.CompletedProcess[str]:
        return stack.docker("exec", container, "sh", "-c", command, check=False)

    def in_store() -> list[str]:
        return stack.compose("exec", "-T", "proxy", "ls", "-A", content, timeout_s=60).stdout.split()

    stack.compose("exec", "-T", "proxy", "sh", "-c", f"mkdir -p {marker} && echo '{{}}' > {marker}/adapter_config.json",
                  timeout_s=60)
    try:
        for row in stack.containers(stack.plan.replica_service):
            assert set(run_in(row["ID"], f"ls -A {ADAPTER_ROOT}").stdout.split()) == {".content", ".fleet", "models"}, \
                f"{row['Name']} sees more of the store than the models, its claims and the content store"
            assert run_in(row["ID"], f"cat {marker}/adapter_config.json").stdout.strip() == "{}", row["Name"]
            wrote = run_in(row["ID"], f"touch {marker}/intruder")
            assert wrote.returncode != 0 and "Read-only" in wrote.stderr, f"{row['Name']} writes the content store"
        assert run_in(trainer_row["ID"], f"ls -A {ADAPTER_ROOT}").stdout.split() == ["models", "runs"]
        seen = run_in(trainer_row["ID"], f"ls -A {content}")
        assert seen.returncode != 0, f"the trainer sees the content store: {seen.stdout}"
        run_in(trainer_row["ID"], f"mkdir -p {content}/intruder")  # its own container layer, if its user may
        assert "intruder" not in in_store(), "a trainer wrote into the content store"

        for path in (marker, f"{ADAPTER_ROOT}/models"):
            status, _, body = in_container(stack, trainer_row["ID"], LOAD, "intruder", path).strip().partition(" ")
            assert status in ("400", "403"), f"a load of {path} answered {status}: {body}"
            assert json.loads(body)["error"]["code"] == int(status), body
        assert "intruder" not in ledger(fleet(stack)), "a refused load reached the ledger"
    finally:
        stack.compose("exec", "-T", "proxy", "rm", "-rf", marker, timeout_s=60, check=False)


def test_the_trainer_trains_and_every_replica_serves_every_version(stack: Stack) -> None:
    wait_for(lambda: last_step(stack) >= 4, "four training steps", 1800, every_s=5,
             alive=lambda: trainer_running(stack))
    assert_ratio_in_bounds(metrics(stack))
    wait_for(lambda: every_replica_serves_the_ledger(stack), "every replica serving the ledger's adapters", 300)
    run = f"{ADAPTER_ROOT}/runs/{RUN_NAME}"
    written = stack.compose("exec", "-T", "proxy", "sh", "-c", f"ls {shlex.quote(run)}").stdout.split()
    assert any(name.startswith("checkpoint-") for name in written), written


def test_every_replica_gives_identical_greedy_tokens_and_logprobs(stack: Stack) -> None:
    adapter = list(ledger(fleet(stack)))[-1]
    body = json.dumps({"model": adapter, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "logprobs": 1,
                       "return_token_ids": True, "ignore_eos": True, "seed": 0})
    choices = {row["Name"]: json.loads(in_container(stack, row["ID"], REPLICA_CALL, "/v1/completions", body))[
        "choices"][0]
               for row in stack.containers(stack.plan.replica_service)}
    (first, reference), *others = choices.items()
    assert len(reference["token_ids"]) == 24
    for name, choice in others:
        assert choice["token_ids"] == reference["token_ids"], f"{name} and {first} generate different tokens"
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            reference["logprobs"]["token_logprobs"], abs=LOGPROB_ABS), f"{name} and {first} disagree on logprobs"


def before_its_restart(stack: Stack, state: dict[str, Any]) -> str:
    """How a restarted container's previous process ended: the last lines it logged before the current one started."""
    return stack.logs(state["Id"], "--until", state["State"]["StartedAt"], "--tail", "40", check=False)


def started_at(stack: Stack, container: str) -> float:
    """When the container's main process last started (Docker's State.StartedAt, nanoseconds), as Unix time."""
    whole, _, fraction = stack.inspect(container)["State"]["StartedAt"].rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{fraction or 0}")


def serving_after_start_s(stack: Stack, container: str, model: str, gone_at: float) -> float:
    """Seconds from the proxy container's process (re)starting after `gone_at` to the first completion the public port
    answers 200: polled every 50 ms from the host, the container's own start time from Docker."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            answer = httpx.post(stack.plan.public_url + "/v1/completions", timeout=10, json={
                "model": model, "prompt": "back", "max_tokens": 1}, headers={
                "Authorization": f"Bearer {stack.plan.api_key}"})
        except httpx.HTTPError:
            answer = None
        if answer is not None and answer.status_code == 200:
            served = time.time()
            start = started_at(stack, container)
            if start > gone_at:  # not the old process's last answer
                return served - start
        time.sleep(0.05)
    raise AssertionError("the public port did not answer a completion within 600 s of the proxy's return")


def store_entries(stack: Stack, run: str) -> list[str]:
    """What run `run`'s directory holds, as the proxy (the whole store, read-only) sees it."""
    return stack.compose("exec", "-T", "proxy", "ls", "-A", f"{ADAPTER_ROOT}/runs/{run}", timeout_s=60).stdout.split()


def assert_trainer_sees_only_its_run(stack: Stack, container: str, run: str, other: str) -> None:
    """The trainer of `run` (its container) has its own run's directory and the store's models (read-only), nothing
    else of the store: `other`'s adapters and checkpoints, which the store holds, are not there to read, a write
    into `other`'s directory fails and never reaches the store."""
    runs = f"{ADAPTER_ROOT}/runs"
    theirs = [name for name in store_entries(stack, other) if name.startswith("checkpoint-") or name == LORA_DIR_NAME]
    assert LORA_DIR_NAME in theirs and len(theirs) > 1, f"run {other} has no adapters and checkpoints yet: {theirs}"

    def in_trainer(command: str) -> subprocess.CompletedProcess[str]:
        return stack.docker("exec", container, "sh", "-c", command, check=False)

    assert in_trainer(f"ls -A {runs}").stdout.split() == [run], f"run {run}'s trainer sees other runs"
    for name in theirs:
        seen = in_trainer(f"ls {runs}/{other}/{name}")
        assert seen.returncode != 0, f"run {run}'s trainer reads run {other}'s {name}: {seen.stdout[:200]}"
    wrote = in_trainer(f"echo intruder > {runs}/{other}/intruder")
    assert wrote.returncode != 0, f"run {run}'s trainer wrote into run {other}'s directory"
    assert "intruder" not in store_entries(stack, other)
    models = in_trainer(f"touch {ADAPTER_ROOT}/models/intruder")
    assert models.returncode != 0 and "Read-only" in models.stderr, f"the models are writable: {models}"


def test_two_runs_train_through_the_proxy_killed_and_a_minute_without_a_fleet(stack: Stack) -> None:
    """A second run (`make train RUN=b`: its own key, mounted into its trainer alone) trains with the stack's own.
    The proxy container's main process is killed (Docker restarts it), then the proxy is stopped for a minute (and
    until each trainer has met the outage: one busy with a step meets it at its next sync, however slow the machine)
    and started: both trainers wait (logged), neither exits nor is restarted, both train on with every step once and
    in order, and the ledger the proxy restored and every replica's own list agree. How soon the fleet serves after the
    proxy's process is back is measured (results/stack/proxy-outage.json, docs/guides/preemption.md#the-proxy-gone)."""
    second = f"lorafleet-train-{SECOND_RUN}"
    containers = {RUN_NAME: lambda: trainer(stack), SECOND_RUN: lambda: stack.inspect(second)}
    (proxy,) = stack.containers("proxy")
    model = base_model(stack)

    def both_training() -> bool:
        for run, state in containers.items():
            assert state()["State"]["Running"], f"run {run}'s trainer ended: {state()['State']}"
        return True

    def train_on(what: str, steps_after: int = 2) -> None:
        reached = {run: last_step(stack, run) for run in containers}
        wait_for(lambda: all(last_step(stack, run) >= reached[run] + steps_after for run in containers),
                 f"both runs training {what}", 900, every_s=5, alive=both_training)

    stack.make("train", f"RUN={SECOND_RUN}", timeout_s=300)
    try:
        wait_for(lambda: last_step(stack, SECOND_RUN) >= 1, f"run {SECOND_RUN}'s first step", 900, every_s=5,
                 alive=both_training)
        assert_trainer_sees_only_its_run(stack, second, SECOND_RUN, RUN_NAME)
        first_view = stack.docker("exec", trainer(stack)["Id"], "ls", "-A", f"{ADAPTER_ROOT}/runs").stdout.split()
        assert first_view == [RUN_NAME], f"run {RUN_NAME}'s trainer sees {first_view}"
        restarts = {run: state()["RestartCount"] for run, state in containers.items()}
        proxy_restarts = stack.inspect(proxy["ID"])["RestartCount"]

        # A crash, not `docker kill` (a manual stop, which Docker does not restart): the proxy's main process dies.
        killed_at = time.time()
        os.kill(stack.inspect(proxy["ID"])["State"]["Pid"], 9)
        after_kill_s = serving_after_start_s(stack, proxy["ID"], model, killed_at)
        assert stack.inspect(proxy["ID"])["RestartCount"] == proxy_restarts + 1
        train_on("after the proxy was killed")

        waits_before = {run: stack.logs(state()["Id"]).count(FLEET_WAIT_LINE) for run, state in containers.items()}
        stack.compose("stop", "proxy", timeout_s=120)
        stopped_at = time.time()
        wait_for(lambda: all(stack.logs(state()["Id"]).count(FLEET_WAIT_LINE) > waits_before[run]
                             for run, state in containers.items()),
                 "both trainers logging their wait for the stopped proxy", MET_OUTAGE_S, every_s=5, alive=both_training)
        time.sleep(max(0.0, stopped_at + OUTAGE_S - time.time()))
        assert both_training()
        stack.compose("start", "proxy", timeout_s=120)
        after_stop_s = serving_after_start_s(stack, proxy["ID"], model, stopped_at)
        train_on("after a minute without a fleet")
        restarted = [state() for run, state in containers.items() if state()["RestartCount"] != restarts[run]]
        assert not restarted, "a trainer was restarted: it died waiting for the fleet\n" + "\n".join(
            f"{gone['Name']}: {gone['State']}\n{before_its_restart(stack, gone)}" for gone in restarted)
        wait_for(lambda: every_replica_serves_the_ledger(stack, (RUN_NAME, SECOND_RUN)),
                 "every replica serving both runs' ledger adapters", 300)

        stack.docker("stop", "--time", "300", second, timeout_s=400)  # parked: its adapters stay served
        assert stack.inspect(second)["State"]["ExitCode"] == 0, stack.inspect(second)["State"]
        logs = {run: stack.logs(state()["Id"]) for run, state in containers.items()}
    finally:
        stack.docker("rm", "--force", second, check=False)
    for run in containers:
        logged = trained_steps(metrics(stack, run))
        assert logged == list(range(logged[0], logged[0] + len(logged))), f"run {run}: steps repeated or skipped: " \
            f"{logged}"
        assert logs[run].count(FLEET_WAIT_LINE) > waits_before[run], f"run {run} did not log its wait"
    figures = {"outage_s": OUTAGE_S, "serving_after_kill_s": round(after_kill_s, 2),
               "serving_after_stop_s": round(after_stop_s, 2), "profile": stack.plan.profile}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "proxy-outage.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nthe fleet served {after_kill_s:.2f} s after the killed proxy's process was back, "
          f"{after_stop_s:.2f} s after the stopped one was started again")


def test_stopping_the_trainer_checkpoints_and_starting_it_resumes(stack: Stack) -> None:
    before = trainer(stack)
    stack.compose("stop", stack.plan.trainer_service, timeout_s=300)
    stopped = trainer(stack)
    assert stopped["State"]["Status"] == "exited" and stopped["State"]["ExitCode"] == 0, stopped["State"]
    time.sleep(5)
    assert not trainer_running(stack) and trainer(stack)["RestartCount"] == before["RestartCount"], \
        "a cleanly stopped trainer was restarted"
    step_at_stop = last_step(stack)
    run = f"{ADAPTER_ROOT}/runs/{RUN_NAME}"
    checkpoints = stack.compose("exec", "-T", "proxy", "ls", run).stdout.split()
    assert f"checkpoint-{step_at_stop}" in checkpoints, f"no checkpoint at step {step_at_stop}: {checkpoints}"

    stack.compose("start", stack.plan.trainer_service, timeout_s=300)
    wait_for(lambda: last_step(stack) > step_at_stop, "a step after the restart", 1200, every_s=5,
             alive=lambda: trainer_running(stack))
    logged = steps(metrics(stack))
    assert logged == list(range(1, max(logged) + 1)), f"steps repeated or skipped across the restart: {logged}"
    logs = stack.compose("logs", "--no-color", stack.plan.trainer_service).stdout
    assert f"checkpoint-{step_at_stop}" in logs, "the restarted trainer did not say it resumes from the checkpoint"
    # Stopped again, as a user parks a run: the steps that follow (scale, crash) are about the fleet, and on a 2-core
    # CI machine a trainer at work would take the CPU a starting replica needs. Its adapters stay served.
    stack.compose("stop", stack.plan.trainer_service, timeout_s=300)
    assert trainer(stack)["State"]["ExitCode"] == 0, trainer(stack)["State"]


def prompt_records(stack: Stack) -> list[dict[str, Any]]:
    """The stack run's prompts.jsonl (a line per optimizer step, prompt_log's format), as the proxy reads it."""
    path = f"{ADAPTER_ROOT}/runs/{RUN_NAME}/{PROMPTS_FILE}"
    result = stack.compose("exec", "-T", "proxy", "cat", path, timeout_s=60, check=False)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()] if result.returncode == 0 else []


def checkpoints(stack: Stack) -> set[str]:
    return {name for name in store_entries(stack, RUN_NAME) if name.startswith("checkpoint-")}


def restart_trainer(stack: Stack, *, recreate: bool = False) -> dict[str, Any]:
    """The trainer brought back as an operator does: `docker compose start` of the killed container (its config and
    log kept), or, after an edit of .env, `docker compose up -d --no-deps` with ADAPTERS_DIR as `make up` sets it
    (compose.yaml's trainer binds its run folder from the adapters volume's directory on the engine's host)."""
    if not recreate:
        stack.compose("start", stack.plan.trainer_service, timeout_s=300)
        return trainer(stack)
    volume = stack.docker("volume", "inspect", "--format", "{{.Mountpoint}}", f"{stack.plan.project}_adapters",
                          timeout_s=60).stdout.strip()
    checked(stack.runner(["env", f"ADAPTERS_DIR={volume}", "docker", "compose", "--project-directory",
                          str(stack.directory), "--profile", stack.plan.profile, "up", "-d", "--no-deps",
                          stack.plan.trainer_service], 300))
    return trainer(stack)


def docker_kill(stack: Stack, state: dict[str, Any]) -> None:
    """`docker kill` (SIGKILL to the whole container), then wait until its process is gone."""
    stack.docker("kill", state["Id"])
    wait_for(lambda: stack.inspect(state["Id"])["State"]["Pid"] != state["State"]["Pid"], "the killed trainer gone", 60,
             every_s=0.5)


def test_a_trainer_container_killed_twice_resumes_without_loss(stack: Stack, tmp_path: Path) -> None:
    """The parked run is given KILLED_RUN_STEPS more steps (MAX_STEPS in .env, the run's total across starts; the
    trainer recreated with it), then `docker kill`ed twice, at moments read from the run folder (not timed): after a
    step of the start, while its rollouts for the next are generated; and the moment a new checkpoint folder appears
    (written or being written). `docker kill` is a manual stop to Docker: `restart: on-failure` does not restart it
    (Engine 20.10, checked: exit 137, RestartCount 0; a crash of the main process is restarted), so each time the
    trainer is brought back as an operator would, `docker compose start`. The last start runs to MAX_STEPS and exits
    0, not restarted. The chaos checker (lorafleet_testing.chaos.judge.check_run) then judges the run folder, copied out
    of the volume, with the container's log over its starts: finished, no step past MAX_STEPS, the resume contract,
    versions only going up, the published-version window and the importance ratio."""
    started = time.monotonic()
    stack.compose("stop", stack.plan.trainer_service, timeout_s=300)  # parked (a no-op after the previous test)
    parked = effective(prompt_records(stack))
    max_steps = (parked[-1]["step"] if parked else 0) + KILLED_RUN_STEPS
    original_env = stack.env_file.read_text()
    kills: list[dict[str, Any]] = []
    try:
        stack.env_file.write_text(stack_plan.user_env_file(original_env, {"MAX_STEPS": str(max_steps)}))
        lines = len(prompt_records(stack))
        state = restart_trainer(stack, recreate=True)
        wait_for(lambda: len(prompt_records(stack)) > lines, "a step of the first start", 1200, every_s=0.5,
                 alive=lambda: trainer_running(stack))
        docker_kill(stack, state)
        kills.append({"phase": "generating", "after_step": prompt_records(stack)[-1]["step"]})

        before = checkpoints(stack)
        state = restart_trainer(stack)
        written = wait_for(lambda: checkpoints(stack) - before, "a checkpoint of the second start", 1200, every_s=0.2,
                           alive=lambda: trainer_running(stack))
        docker_kill(stack, state)
        checkpoint = max(written, key=lambda name: int(name.removeprefix("checkpoint-")))
        mid_write = WRITING_MARKER in store_entries(stack, f"{RUN_NAME}/{checkpoint}")
        kills.append({"phase": "checkpoint_write" if mid_write else "checkpoint_written", "checkpoint": checkpoint})

        state = restart_trainer(stack)
        wait_for(lambda: not trainer_running(stack), f"the run's last start reaching MAX_STEPS={max_steps}", 1800,
                 every_s=5)
        finished = trainer(stack)
    finally:
        stack.env_file.write_text(original_env)
    assert finished["State"]["ExitCode"] == 0, finished["State"]
    assert finished["RestartCount"] == state["RestartCount"], "the finished trainer was restarted"

    folder = tmp_path / RUN_NAME
    (proxy,) = stack.containers("proxy")
    stack.docker("cp", f"{proxy['ID']}:{ADAPTER_ROOT}/runs/{RUN_NAME}", str(folder), timeout_s=300)
    spec = RunSpec(max_steps=max_steps, max_staleness=int(CommonSettings.model_fields["max_staleness"].default),
                   exit_code=finished["State"]["ExitCode"], log=stack.logs(finished["Id"]),
                   rows=TINY_PROMPTS if stack.plan.profile == "cpu" else None)
    violations = check_run(RUN_NAME, spec, folder)
    assert not violations, "\n".join(f"VIOLATION {v.invariant}: {v.reason}\n  first bad record: {v.record}"
                                     for v in violations)
    figures = {"kills": kills, "max_steps": max_steps, "starts": 3, "test_s": round(time.monotonic() - started, 1),
               "profile": stack.plan.profile}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "trainer-kills.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nkilled twice ({kills}), resumed, finished at {max_steps}: {figures['test_s']} s")


def test_make_scale_under_traffic_syncs_the_new_replica_before_it_gets_traffic(stack: Stack) -> None:
    grown = stack.plan.replicas + 1
    before = {row["Name"] for row in stack.containers(stack.plan.replica_service)}
    seen_routed: list[dict[str, Any]] = []
    with Traffic(stack) as traffic:
        traffic.wait_sent(3)
        stack.make("scale", f"N={grown}", timeout_s=WAIT_S + 600)
        (new,) = [row for row in stack.containers(stack.plan.replica_service) if row["Name"] not in before]
        host = stack.container_ip(new["ID"])

        def routed_to_new() -> dict[str, Any] | None:
            snapshot = fleet(stack)
            entry = next((r for r in snapshot["replicas"] if url_host(r["url"]) == host), None)
            if entry and entry["routed"] > 0:
                seen_routed.append({"entry": entry, "ledger": ledger(snapshot)})
                return entry
            return None

        wait_for(routed_to_new, "traffic on the new replica", 900, every_s=0.5)
        traffic.wait_sent(3)
    assert not traffic.failures, f"{len(traffic.failures)} of {traffic.sent} completions failed: {traffic.failures[:3]}"
    first = seen_routed[0]
    assert first["entry"]["state"] == "ready" and first["entry"]["generates"], first["entry"]
    assert set(first["ledger"]) <= set(first["entry"]["adapters"]), "the new replica got traffic before it held " \
        f"{set(first['ledger']) - set(first['entry']['adapters'])}"
    wait_for(lambda: all_ready(stack, grown), f"{grown} ready, synced replicas", 900)
    assert_devices_spread(stack, grown)
    if stack.plan.profile == "gpu":
        assert_gpus_held_one_each(stack)


def test_a_crashed_replica_restarts_and_resyncs_with_no_client_visible_failure(stack: Stack) -> None:
    replicas = stack.containers(stack.plan.replica_service)
    victim = replicas[-1]
    host = stack.container_ip(victim["ID"])
    restarts = stack.inspect(victim["ID"])["RestartCount"]
    with Traffic(stack) as traffic:
        traffic.wait_sent(3)
        # A crash, not `docker kill` (a manual stop, which Docker does not restart): the main process dies.
        os.kill(stack.inspect(victim["ID"])["State"]["Pid"], 9)
        wait_for(lambda: host not in {url_host(u) for u in stack_plan.ready_urls(fleet(stack))}, "the dead replica out",
                 120, every_s=0.5)
        wait_for(lambda: stack.inspect(victim["ID"])["RestartCount"] > restarts, "Docker restarting it", 120)
        traffic.wait_sent(3)

        wait_back_in_traffic(stack, host, len(replicas), "the restarted replica")
    assert not traffic.failures, f"{len(traffic.failures)} of {traffic.sent} completions failed: {traffic.failures[:3]}"
    assert_devices_spread(stack, len(replicas))


def test_a_paused_replica_leaves_routing_and_comes_back_with_no_client_visible_failure(stack: Stack) -> None:
    """`docker pause` freezes a replica: its port accepts, nothing answers. Once its health checks have timed out for
    PROXY_EJECT_SLOW_AFTER_S it leaves routing and the requests it held are retried on another replica; unpaused, it
    re-syncs and takes traffic again."""
    replicas = stack.containers(stack.plan.replica_service)
    frozen = replicas[0]
    host = stack.container_ip(frozen["ID"])
    with Traffic(stack) as traffic:
        traffic.wait_sent(3)
        stack.docker("pause", frozen["ID"])
        try:
            wait_for(lambda: host not in {url_host(u) for u in stack_plan.ready_urls(fleet(stack))},
                     "the paused replica out of routing", 300, every_s=0.5)
            traffic.wait_sent(3)
        finally:
            stack.docker("unpause", frozen["ID"])

        wait_back_in_traffic(stack, host, len(replicas), "the unpaused replica")
    assert not traffic.failures, f"{len(traffic.failures)} of {traffic.sent} completions failed: {traffic.failures[:3]}"


def test_make_down_keeps_the_volumes_and_down_v_removes_everything(stack: Stack) -> None:
    stack.make("down", timeout_s=600)
    left = stack.leftovers()
    assert set(left) == {"volumes"}, f"after make down: {left}"
    stack.compose("down", "--volumes", timeout_s=600)
    assert stack.leftovers() == {}, f"after down -v: {stack.leftovers()}"

