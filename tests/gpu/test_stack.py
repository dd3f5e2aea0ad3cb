"""The Compose stack end to end on a Docker host: `make test-gpu` (NVIDIA GPUs) or `make test-stack CPU=1`.

Not part of `make test` (CI has no engine and no GPU); there every test here skips with one line naming what
is missing, and tests/compose/test_stack_env.py proves the env file and layout this module uses.

One stack per module, under its own Compose project name and env file (stack_plan.StackPlan):
  1. every replica is `ready` in /fleet (not just the proxy healthy) and runs on its own device;
  2. gpu profile: the GPUs the replicas' processes hold (host nvidia-smi) are distinct and not the trainer's;
  3. the public port answers 401 to a wrong and to a missing key, 200 to the right one;
  4. a short real training run: exit 0, importance ratio within the doctor's bounds, every published adapter
     loaded on every replica (as the replicas themselves list them);
  5. the same greedy request gives identical tokens and logprobs on every replica;
  6. `--scale` up by one: the new replica claims a free device and holds every adapter before traffic;
  7. a replica container killed mid-run: no rollout fails, and once started again it re-syncs and takes traffic.
The stack is always removed with `down -v`; when a test failed, `docker compose logs` is saved under
results/stack/ (the GPU workflow uploads it).

Knobs: LORAFLEET_STACK_PROFILE (gpu|cpu), LORAFLEET_STACK_REPLICAS (2), LORAFLEET_STACK_MODEL (default: a small
public instruct model on GPU, the tiny model on CPU), LORAFLEET_STACK_BUILD=1 (build the images first; the
make targets set it), LORAFLEET_STACK_REQUIRED=1 (fail instead of skip where the host cannot run it; the make
targets set it too), LORAFLEET_STACK_WAIT_S (`up --wait` limit).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from lorafleet.adapters import metrics_path
from lorafleet.doctor import RATIO_FAIL
from lorafleet.settings import Settings
from stack_driver import REPO, Compose, StackSession, detect_gpus, host_nvidia_smi, missing_requirements
from stack_plan import (
    RUN_NAME,
    Profile,
    StackPlan,
    device_from_environ,
    gpus_held,
    ledger,
    metric_rows,
    parse_compute_apps,
    parse_gpu_indices,
    parse_top_pids,
    plan_stack,
    ready_urls,
    unsynced,
    url_host,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(7200)]

PROFILE: Profile = "cpu" if os.environ.get("LORAFLEET_STACK_PROFILE") == "cpu" else "gpu"
REPLICAS = int(os.environ.get("LORAFLEET_STACK_REPLICAS", "2"))
WAIT_S = int(os.environ.get("LORAFLEET_STACK_WAIT_S", "1800" if PROFILE == "gpu" else "900"))
ARTIFACTS = REPO / "results" / "stack"
CHAOS_RUN = "stack-chaos"
PROMPT = "<|im_start|>user\nWhat is 17 + 25? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
# Same weights, same kernels, one request at a time: greedy decoding agrees exactly; the tolerance only absorbs
# the last bits of bf16 reductions on GPUs of one model.
LOGPROB_ABS = 1e-5 if PROFILE == "cpu" else 1e-3

T = TypeVar("T")

# Runs inside a replica container: one greedy completion from that replica's own vLLM (replicas are not published).
GREEDY = """
import os, sys, urllib.request
body = sys.argv[1].encode()
url = "http://127.0.0.1:%s/v1/completions" % os.environ.get("REPLICA_PORT", "8000")
request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=300).read().decode())
"""
MODELS = """
import os, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/v1/models" % os.environ.get("REPLICA_PORT", "8000"),
                             timeout=30).read().decode())
"""


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    reason = missing_requirements(PROFILE, REPLICAS)
    if reason and os.environ.get("LORAFLEET_STACK_REQUIRED") == "1":  # make test-gpu / test-stack asked for it
        pytest.fail(reason, pytrace=False)
    if reason:
        pytest.skip(reason)
    plan = plan_stack(PROFILE, replicas=REPLICAS, gpus=detect_gpus() if PROFILE == "gpu" else None,
                      cores=os.cpu_count(), model=os.environ.get("LORAFLEET_STACK_MODEL") or None)
    compose = Compose(plan, tmp_path_factory.mktemp("stack"))
    session = StackSession(compose, ARTIFACTS, build=os.environ.get("LORAFLEET_STACK_BUILD") == "1",
                           wait_timeout_s=WAIT_S)
    session.start()  # tears down (and saves logs) itself when `up` fails
    failed_before = request.session.testsfailed
    try:
        yield compose
    finally:
        logs = session.stop(failed=request.session.testsfailed > failed_before)
        if logs:
            print(f"\ncompose logs saved to {logs}")


# --- helpers ----------------------------------------------------------------------------------------------------


def public(plan: StackPlan, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(plan.public_url + path, headers=headers, timeout=30)


def fleet(compose: Compose) -> dict[str, Any]:
    response = public(compose.plan, "/fleet", compose.plan.api_key)
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


def all_ready(compose: Compose, count: int) -> dict[str, Any] | None:
    """The /fleet snapshot once exactly `count` replicas are ready and hold every ledger adapter."""
    snapshot = fleet(compose)
    return snapshot if len(ready_urls(snapshot)) == count and not unsynced(snapshot) else None


def replica_devices(compose: Compose) -> dict[str, str | None]:
    """Container -> the device its vLLM process (PID 1 after the entrypoint's exec) was started on."""
    return {row["Name"]: device_from_environ(compose.docker("exec", row["ID"], "cat", "/proc/1/environ").stdout,
                                             compose.plan.profile)
            for row in compose.containers(compose.plan.replica_service)}


def assert_distinct_devices(compose: Compose, count: int) -> None:
    devices = replica_devices(compose)
    assert len(devices) == count, devices
    assert None not in devices.values(), f"a replica's vLLM has no claimed device: {devices}"
    assert len(set(devices.values())) == count, f"replicas share a device: {devices}"
    assert set(devices.values()) <= set(compose.plan.replica_pool), f"outside the pool: {devices}"


def assert_gpus_held_one_each(stack: Compose) -> None:
    """What the hardware says, not the logs (problem 7): host nvidia-smi's pids per GPU against `docker top`."""
    index_of = parse_gpu_indices(host_nvidia_smi("--query-gpu=index,uuid"))
    apps = parse_compute_apps(host_nvidia_smi("--query-compute-apps=pid,gpu_uuid"))
    pids = {row["Name"]: parse_top_pids(stack.docker("top", row["ID"], "-eo", "pid").stdout)
            for row in stack.containers(stack.plan.replica_service)}
    held = gpus_held(pids, apps, index_of)
    assert all(len(gpus) == 1 for gpus in held.values()), f"each replica should hold exactly one GPU: {held}"
    taken = [next(iter(gpus)) for gpus in held.values()]
    assert len(set(taken)) == len(taken), f"replicas share a GPU: {held}"
    assert set(taken) <= set(stack.plan.replica_pool), f"a replica holds a GPU outside VLLM_GPUS: {held}"
    assert not set(taken) & set(stack.plan.trainer_gpus), f"a replica holds the trainer's GPU: {held}"


def run_in_replica(compose: Compose, container: str, script: str, *args: str) -> Any:
    return json.loads(compose.docker("exec", container, "python3", "-c", script, *args, timeout_s=600).stdout)


def metrics(compose: Compose, run: str) -> list[dict[str, Any]]:
    path = metrics_path(Settings.model_fields["adapter_root"].default, run)  # the stack's ADAPTER_ROOT: the default
    result = compose.run("exec", "-T", "proxy", "cat", str(path), check=False)
    return metric_rows(result.stdout) if result.returncode == 0 else []


def steps(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({int(row["step"]) for row in rows if "step" in row})


def last_step(compose: Compose, run: str) -> int:
    return max(steps(metrics(compose, run)), default=0)


def retries(rows: list[dict[str, Any]]) -> float:
    return sum(float(row.get("rollout/vllm_retry_total", 0)) for row in rows)


def assert_ratio_in_bounds(rows: list[dict[str, Any]]) -> None:
    ratios = [float(row["ratio"]) for row in rows if "ratio" in row]
    assert ratios, "the run logged no importance ratio"
    outside = [r for r in ratios if abs(r - 1) > RATIO_FAIL]
    assert not outside, f"importance ratio left [{1 - RATIO_FAIL}, {1 + RATIO_FAIL}] (doctor FAIL): {ratios}"


# --- tests, in order: each builds on the stack the previous left ------------------------------------------------


def test_every_replica_is_ready_on_its_own_device(stack: Compose) -> None:
    # `up --wait` returns once the proxy is healthy, i.e. one replica is ready (problem 4): wait for all of them,
    # each on a device of its own (problem 1: the env file gives the replicas a pool of their own).
    snapshot = wait_for(lambda: all_ready(stack, stack.plan.replicas), f"{stack.plan.replicas} ready replicas", 900)
    assert len(snapshot["replicas"]) == stack.plan.replicas, snapshot["replicas"]
    assert_distinct_devices(stack, stack.plan.replicas)


def test_each_replica_holds_a_different_gpu(stack: Compose) -> None:
    if stack.plan.profile != "gpu":
        pytest.skip("cpu profile: no GPUs to hold (core sets are checked by the device test)")
    assert_gpus_held_one_each(stack)


def test_public_port_rejects_wrong_and_missing_keys(stack: Compose) -> None:
    """Problem 7: a wrong key too, not only a missing one; the port comes from the same env file (problem 5)."""
    plan = stack.plan
    for key in (None, plan.api_key + "-wrong", ""):
        response = public(plan, "/v1/models", key)
        assert response.status_code == 401, (key is None, response.status_code, response.text)
        assert response.json()["error"]["code"] == 401
    assert public(plan, "/v1/models", plan.api_key).status_code == 200


def test_short_training_run_syncs_every_replica(stack: Compose) -> None:
    """Problem 7: real training on the stack (GPU: the small instruct model on the math recipe)."""
    stack.run_trainer(timeout_s=3600)  # raises with the trainer's output unless it exits 0
    rows = metrics(stack, RUN_NAME)
    assert steps(rows) == list(range(1, int(stack.plan.settings["MAX_STEPS"]) + 1)), steps(rows)
    assert_ratio_in_bounds(rows)
    snapshot = wait_for(lambda: all_ready(stack, stack.plan.replicas), "every replica synced", 300)
    live = ledger(snapshot)
    assert live and all(f"/runs/{RUN_NAME}/" in path for path in live.values()), live
    for row in stack.containers(stack.plan.replica_service):  # the replicas' own word, not the proxy's
        served = {card["id"]: card["root"] for card in run_in_replica(stack, row["ID"], MODELS)["data"]
                  if card.get("parent")}
        assert served == live, f"{row['Name']} serves {served}, the ledger is {live}"


def test_every_replica_gives_identical_greedy_tokens_and_logprobs(stack: Compose) -> None:
    adapter = list(ledger(fleet(stack)))[-1]  # the newest version the training run published
    body = json.dumps({"model": adapter, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "logprobs": 1,
                       "return_token_ids": True, "ignore_eos": True, "seed": 0})
    choices = {row["Name"]: run_in_replica(stack, row["ID"], GREEDY, body)["choices"][0]
               for row in stack.containers(stack.plan.replica_service)}
    (first, reference), *others = choices.items()
    assert len(reference["token_ids"]) == 24
    for name, choice in others:
        assert choice["token_ids"] == reference["token_ids"], f"{name} and {first} generate different tokens"
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            reference["logprobs"]["token_logprobs"], abs=LOGPROB_ABS), f"{name} and {first} disagree on logprobs"


def test_scale_out_claims_a_free_device_and_syncs_before_traffic(stack: Compose) -> None:
    grown = stack.plan.replicas + 1
    before = {row["Name"] for row in stack.containers(stack.plan.replica_service)}
    live = ledger(fleet(stack))
    stack.up(grown, WAIT_S)
    (new,) = [row for row in stack.containers(stack.plan.replica_service) if row["Name"] not in before]
    url_of_new = stack.container_ip(new["ID"])
    snapshot = wait_for(lambda: all_ready(stack, grown), f"{grown} ready, synced replicas", 900)
    entry = next(r for r in snapshot["replicas"] if url_host(r["url"]) == url_of_new)
    assert set(live) <= set(entry["adapters"]), f"the new replica is ready without {set(live) - set(entry['adapters'])}"
    assert_distinct_devices(stack, grown)
    if stack.plan.profile == "gpu":
        assert_gpus_held_one_each(stack)


def test_replica_killed_mid_run_loses_no_rollout_and_resyncs(stack: Compose) -> None:
    replicas = stack.containers(stack.plan.replica_service)
    count = len(replicas)
    trainer = f"{stack.plan.project}-chaos"
    stack.run_trainer("--detach", "--name", trainer, env={"RUN_NAME": CHAOS_RUN, "MAX_STEPS": "1000"}, timeout_s=300)

    def trainer_alive() -> bool:
        state = stack.docker("inspect", "--format", "{{.State.Running}}", trainer, check=False).stdout.strip()
        return state == "true"

    try:
        wait_for(lambda: last_step(stack, CHAOS_RUN) >= 2, "two training steps", 1800, alive=trainer_alive)
        victim = replicas[-1]
        victim_host = stack.container_ip(victim["ID"])
        retries_before = retries(metrics(stack, CHAOS_RUN))
        step_at_kill = last_step(stack, CHAOS_RUN)
        stack.docker("kill", victim["ID"])
        wait_for(lambda: victim_host not in {url_host(u) for u in ready_urls(fleet(stack))}, "the dead replica out",
                 120, every_s=0.5, alive=trainer_alive)
        wait_for(lambda: last_step(stack, CHAOS_RUN) >= step_at_kill + 2, "two steps without it", 1200,
                 alive=trainer_alive)
        assert retries(metrics(stack, CHAOS_RUN)) == retries_before, "a rollout failed while a replica died"

        # `docker kill` suspends the restart policy until the next start: start it as an operator would.
        stack.docker("start", victim["ID"])
        host = stack.container_ip(victim["ID"])

        def restarted() -> dict[str, Any] | None:
            snapshot = all_ready(stack, count)  # ready only once it holds every live adapter
            return next((r for r in (snapshot or {}).get("replicas", []) if url_host(r["url"]) == host), None)

        routed = wait_for(restarted, "the restarted replica ready and synced", 1800, alive=trainer_alive)["routed"]
        wait_for(lambda: (restarted() or {}).get("routed", 0) > routed, "traffic on the restarted replica", 600,
                 alive=trainer_alive)
    except BaseException:
        stack.save_container_log(trainer, ARTIFACTS)  # removed (--rm) once stopped
        raise
    finally:
        stack.docker("stop", "--time", "30", trainer, check=False)
    rows = metrics(stack, CHAOS_RUN)
    assert steps(rows) == list(range(1, max(steps(rows)) + 1)), "every optimizer step was logged"
    assert_ratio_in_bounds(rows)
    assert_distinct_devices(stack, count)
