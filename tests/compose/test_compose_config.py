"""compose.yaml, validated by the real Compose v2 CLI and the compose-spec schema, and checked for the stack's rules.

The rules (docs/concepts/architecture.md#topology): replicas are never published; the proxy's public port is on
127.0.0.1 only; `adapters` is mounted at the same absolute path everywhere (ro in the proxy); a trainer mounts
only its own run's directory of it (rw) and its models (ro), a replica the models alone; the content store is the
proxy's to write, the replicas' to read and no trainer's to see; the fleet volume is the proxy's alone; GPUs
are reserved for replicas and trainer; every long-running service has a healthcheck; the trainer starts after a
healthy proxy; required secrets fail fast; the cpu profile runs the same topology without GPUs.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from lorafleet.settings import StackSettings
from lorafleet_testing.compose_helpers import (
    COMPOSE_FILE,
    REPO,
    ComposeResult,
    ComposeRunner,
    EnvFileMaker,
    RenderFn,
    required_compose_vars,
    tool,
)

STACK = {"store-init", "model-fetch", "proxy", "vllm", "trainer"}
ROLE_BY_DOCKERFILE_DIR = {"services/vllm/": "replica", "services/proxy/": "proxy", "services/trainer/": "trainer"}


def role(service: dict[str, Any]) -> str:
    """What a service is, from the Dockerfile it builds; one-shot helpers never restart."""
    if service.get("restart") == "no":
        return "one-shot"
    if "monitoring" in service.get("profiles", []):
        return "monitoring"
    dockerfile = (service.get("build") or {}).get("dockerfile", "")
    roles = [name for prefix, name in ROLE_BY_DOCKERFILE_DIR.items() if dockerfile.startswith(prefix)]
    assert len(roles) == 1, f"cannot tell the role of a service built from {dockerfile!r}"
    return roles[0]


def services_by_role(project: dict[str, Any], wanted: str) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in project["services"].items() if role(svc) == wanted}


def profiles_of(project: dict[str, Any]) -> set[str]:
    return {profile for svc in project["services"].values() for profile in svc.get("profiles", [])}


def mounts(service: dict[str, Any], source: str) -> list[dict[str, Any]]:
    return [v for v in service.get("volumes", []) if v.get("type") == "volume" and v.get("source") == source]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]


def default_of(field: str) -> str:
    return str(StackSettings.model_fields[field].default)


# --- the CLI and the schema accept the file ----------------------------------------------------------------------


def test_every_profile_validates(run_compose: ComposeRunner, make_env_file: EnvFileMaker, project: dict) -> None:
    profiles = profiles_of(project)
    assert {"gpu", "cpu"} <= profiles
    env_file = make_env_file()
    for selection in [("*",), (), *[(p,) for p in sorted(profiles)]]:
        result = run_compose("config", "-q", env_file=env_file, profiles=selection)
        assert result.returncode == 0, f"profiles {selection}: {result.stderr}"


def test_compose_spec_schema_accepts_the_file(tool_env: dict[str, str]) -> None:
    done = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        env=tool_env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_validator_catches_a_broken_file(
    compose_bin: Any, tool_env: dict[str, str], make_env_file: EnvFileMaker, tmp_path: Any
) -> None:
    """The check can fail: the same file with a typo in a depends_on condition is rejected."""
    text = COMPOSE_FILE.read_text()
    assert "condition: service_healthy" in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace("condition: service_healthy", "condition: service_heathy"))
    done = subprocess.run(
        [str(compose_bin), "-f", str(broken), "--project-directory", str(REPO), "--env-file", str(make_env_file()),
         "--profile", "*", "config", "-q"],
        env=tool_env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 1 and re.search(r"depends_on\.\w+\.condition value must be one of", done.stderr), (
        done.stderr)


# --- secrets -----------------------------------------------------------------------------------------------------


def test_required_secrets_fail_fast_when_unset(run_compose: ComposeRunner, make_env_file: EnvFileMaker) -> None:
    required = required_compose_vars()
    assert "PROXY_API_KEY" in required
    for name in sorted(required):
        for value in (None, ""):  # missing from .env, or left empty as in .env.example
            result = run_compose("config", "-q", env_file=make_env_file(**{name: value}))
            assert result.returncode != 0, f"compose accepted an unset {name}"
            assert name in result.stderr, result.stderr


def test_env_example_as_shipped_refuses_to_start(run_compose: ComposeRunner, make_env_file: EnvFileMaker) -> None:
    """`cp .env.example .env && docker compose up` stops at once and says which secret to set, until all are set."""
    required, named = required_compose_vars(), set[str]()

    def config() -> ComposeResult:
        return run_compose("config", "-q", env_file=make_env_file(fill_secrets=False, **dict.fromkeys(named, "s")))

    for _ in required:
        result = config()
        assert result.returncode != 0, f"compose started with only {named} set"
        (missing,) = [name for name in required - named if name in result.stderr] or [result.stderr]
        named.add(missing)
    assert named == required and config().returncode == 0


# --- ports and networks ------------------------------------------------------------------------------------------


def test_no_replica_port_is_published(project: dict) -> None:
    replicas = services_by_role(project, "replica")
    assert {"vllm", "vllm-cpu"} <= set(replicas)
    for name, svc in replicas.items():
        assert not svc.get("ports"), f"{name} publishes {svc['ports']}"
        assert svc.get("network_mode") in (None, ""), f"{name} uses network_mode {svc['network_mode']}"


def test_proxy_public_port_is_on_loopback_only_and_fleet_port_is_not_published(project: dict) -> None:
    (proxy,) = services_by_role(project, "proxy").values()
    ports = proxy.get("ports") or []
    assert [int(p["target"]) for p in ports] == [int(default_of("proxy_public_port"))]
    assert all(p.get("host_ip") == "127.0.0.1" for p in ports), ports
    for name, svc in project["services"].items():
        for port in svc.get("ports") or []:
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            assert int(port["target"]) != int(default_of("proxy_port")), f"{name} publishes the fleet port"


def test_proxy_public_port_follows_its_settings(render: RenderFn) -> None:
    (proxy,) = services_by_role(render(PROXY_PUBLIC_PORT="9443"), "proxy").values()
    assert [(p["host_ip"], str(p["published"]), int(p["target"])) for p in proxy["ports"]] == [
        ("127.0.0.1", "9443", 9443)
    ]


def test_replicas_are_reachable_only_through_the_internal_fleet_network(project: dict) -> None:
    networks = project["networks"]
    (proxy,) = services_by_role(project, "proxy").values()
    dns_host, dns_port = proxy["environment"]["PROXY_UPSTREAM_DNS"].split(":")
    assert dns_port == default_of("replica_port")
    for name, replica in services_by_role(project, "replica").items():
        shared = set(replica["networks"]) & set(proxy["networks"])
        # One shared network, internal: the replica name resolves to exactly one address per replica.
        assert len(shared) == 1, f"{name} and proxy share {shared}"
        (fleet,) = shared
        assert networks[fleet].get("internal") is True
        aliases = (replica["networks"][fleet] or {}).get("aliases") or []
        assert dns_host == name or dns_host in aliases, f"{name} is not found as {dns_host!r}"
        assert replica["environment"]["REPLICA_PORT"] == dns_port, f"{name} listens where the proxy does not look"
    for name, trainer in services_by_role(project, "trainer").items():
        assert set(trainer["networks"]) & set(proxy["networks"]), f"{name} cannot reach the proxy"
        url = trainer["environment"]["TRAINER_VLLM_URL"]
        assert url == f"http://proxy:{proxy['environment']['PROXY_PORT']}", f"{name} does not use the fleet port: {url}"
        assert proxy["environment"]["PROXY_PORT"] == default_of("proxy_port")


def test_trainer_and_model_fetch_can_download_models(project: dict) -> None:
    networks = project["networks"]
    fetchers = {n: s for n, s in project["services"].items() if n.startswith("model-fetch")}
    assert set(fetchers) == {"model-fetch", "model-fetch-cpu"}
    for name, svc in {**fetchers, **services_by_role(project, "trainer")}.items():
        assert any(not networks[n].get("internal") for n in svc["networks"]), f"{name} has no route to the Hub"


# --- volumes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("root", [None, "/srv/lorafleet-store"])
def test_adapters_is_mounted_at_the_same_path_everywhere_with_the_right_modes(render: RenderFn, root: str) -> None:
    project = render(ADAPTER_ROOT=root)
    expected_root = root or default_of("adapter_root")
    # The one-shots that lay out the store, build the cpu profile's tiny (or named) model into it and write the
    # doctor's probe adapter; model-fetch only reads it (a local BASE_MODEL under ADAPTER_ROOT). Trainers mount parts
    # of it (below).
    writers = {"store-init", "tiny-model", "named-model", "doctor", "doctor-cpu"}
    long_running = [n for n, s in project["services"].items() if role(s) != "one-shot"]
    for name, svc in project["services"].items():
        adapters = mounts(svc, "adapters")
        if role(svc) == "replica":
            assert not adapters, f"{name} mounts the whole store"
            continue
        if role(svc) in ("one-shot", "monitoring", "trainer") and not adapters:
            continue
        assert len(adapters) == 1, f"{name} mounts adapters {len(adapters)} times"
        (mount,) = adapters
        assert mount["target"] == expected_root, f"{name} mounts adapters at {mount['target']}"
        writes = role(svc) in writers or name in writers
        assert bool(mount.get("read_only")) == (not writes), f"{name}: wrong mode for adapters"
        if name in long_running:
            assert svc["environment"]["ADAPTER_ROOT"] == expected_root, f"{name} looks for adapters elsewhere"


@pytest.mark.parametrize(("run", "root"), [(None, None), ("b", "/srv/lorafleet-store")])
def test_a_trainer_mounts_only_its_own_run_and_the_models(render: RenderFn, run: str | None, root: str | None) -> None:
    """Issue 47: no trainer holds the whole store; it gets its run's directory (rw) and the models (ro), binds of the
    adapters volume's directory on the engine's host (ADAPTERS_DIR), at their place under ADAPTER_ROOT; the run it
    mounts is the run it trains (RUN_NAME), and store-init makes both directories before it starts."""
    store = "/engine/volumes/lorafleet_adapters/_data"
    project = render(RUN_NAME=run, ADAPTER_ROOT=root, ADAPTERS_DIR=store)
    run, root = run or default_of("run_name"), root or default_of("adapter_root")
    trainers = services_by_role(project, "trainer")
    assert set(trainers) == {"trainer", "trainer-cpu"}
    for name, svc in trainers.items():
        volumes = svc["volumes"]
        assert not [v for v in volumes if v.get("source") in ("adapters", "fleet", "claims")], f"{name}: {volumes}"
        binds = {v["target"]: v for v in volumes if v["type"] == "bind" and v["source"].startswith(store)}
        assert set(binds) == {f"{root}/runs/{run}", f"{root}/models"}, f"{name}: {volumes}"
        own, models = binds[f"{root}/runs/{run}"], binds[f"{root}/models"]
        assert own["source"] == f"{store}/runs/{run}" and not own.get("read_only"), own
        assert models["source"] == f"{store}/models" and models.get("read_only") is True, models
        # A missing directory fails the start instead of the engine making an empty one outside the volume.
        assert all(not (v.get("bind") or {}).get("create_host_path") for v in binds.values()), binds
        assert svc["environment"]["RUN_NAME"] == run and svc["environment"]["ADAPTER_ROOT"] == root
        assert svc["depends_on"]["store-init"]["condition"] == "service_completed_successfully"
    layout = " ".join(project["services"]["store-init"]["entrypoint"])
    assert '"$$0/runs/$$1" "$$0/models"' in layout and layout.endswith(f"{root} {run}"), layout


STORE = "/engine/volumes/lorafleet_adapters/_data"  # ADAPTERS_DIR as `make up` finds it


def content_store_problems(project: dict[str, Any]) -> list[str]:
    """Issue 57: the content store (volume `content` at ADAPTER_ROOT/.content) is mounted rw by the proxy (and
    store-init, which hands it to the proxy's user), read-only by every replica, by nothing else; a replica mounts,
    of the adapters volume, the models alone (read-only), nothing of runs/."""
    problems = []
    root = project["services"]["proxy"]["environment"]["ADAPTER_ROOT"]
    replicas = services_by_role(project, "replica")
    for name, svc in project["services"].items():
        for mount in mounts(svc, "content"):
            writes = name in ("proxy", "store-init")
            if name not in replicas and not writes:
                problems.append(f"{name} mounts the content store")
            elif mount["target"] != f"{root}/.content" or bool(mount.get("read_only")) == writes:
                problems.append(f"{name} mounts the content store at {mount['target']} read_only="
                                f"{mount.get('read_only')}")
    if not mounts(project["services"]["proxy"], "content"):
        problems.append("the proxy does not mount the content store")
    for name, svc in replicas.items():
        if not mounts(svc, "content"):
            problems.append(f"{name} does not mount the content store")
        store = [v for v in svc["volumes"] if v.get("source") == "adapters" or str(v.get("source", "")).startswith(
            STORE) or str(v.get("target", "")).startswith(f"{root}/runs")]
        if [(v["target"], v["source"], v.get("read_only")) for v in store] != [(f"{root}/models", f"{STORE}/models",
                                                                                True)]:
            problems.append(f"{name} mounts of the adapters volume {store}, want its models alone, read-only")
    return problems


@pytest.mark.parametrize("root", [None, "/srv/lorafleet-store"])
def test_the_content_store_is_the_proxys_to_write_the_replicas_to_read_and_no_trainers(render: RenderFn,
                                                                                       root: str | None) -> None:
    project = render(ADAPTER_ROOT=root, ADAPTERS_DIR=STORE)
    assert content_store_problems(project) == []
    assert not [name for name, svc in services_by_role(project, "trainer").items() if mounts(svc, "content")]
    # store-init makes the mount point inside the store and hands the volume to the proxy's user.
    layout = " ".join(project["services"]["store-init"]["entrypoint"])
    assert '"$$0/.content"' in layout and 'chown 10001:10001 "$$0/.content"' in layout, layout


CONTENT_BREAKS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "a trainer mounting it": (lambda p: p["services"]["trainer-cpu"]["volumes"].append(
        {"type": "volume", "source": "content", "target": "/adapters/.content", "read_only": True}),
        "trainer-cpu mounts the content store"),
    "a writable replica mount": (lambda p: mounts(p["services"]["vllm"], "content")[0].pop("read_only"),
                                 "vllm mounts the content store at"),
    "a read-only proxy": (lambda p: mounts(p["services"]["proxy"], "content")[0].update(read_only=True),
                          "proxy mounts the content store at"),
    "a replica without it": (lambda p: p["services"]["vllm-cpu"].update(volumes=[
        v for v in p["services"]["vllm-cpu"]["volumes"] if v.get("source") != "content"]),
        "vllm-cpu does not mount the content store"),
    "a replica with the whole store": (lambda p: p["services"]["vllm"]["volumes"].append(
        {"type": "volume", "source": "adapters", "target": "/adapters", "read_only": True}), "vllm mounts of the"),
    "a replica with a run's folder": (lambda p: p["services"]["vllm"]["volumes"].append(
        {"type": "bind", "source": f"{STORE}/runs/run1", "target": "/adapters/runs/run1", "read_only": True}),
        "vllm mounts of the"),
}


@pytest.mark.parametrize("change", sorted(CONTENT_BREAKS))
def test_the_content_store_check_catches(render: RenderFn, change: str) -> None:
    project = copy.deepcopy(render(ADAPTERS_DIR=STORE))
    breaks, says = CONTENT_BREAKS[change]
    breaks(project)
    found = content_store_problems(project)
    assert any(says in problem for problem in found), found


def test_fleet_state_is_the_proxys_alone_and_replicas_claim_in_their_own_volume(project: dict) -> None:
    root = default_of("adapter_root")
    (proxy,) = services_by_role(project, "proxy").values()
    (fleet,) = mounts(proxy, "fleet")
    assert fleet["target"] == f"{root}/.fleet" and not fleet.get("read_only"), fleet
    # store-init makes the fleet volume writable by the non-root proxy; no other service mounts it.
    holders = {name for name, svc in project["services"].items() if mounts(svc, "fleet")}
    assert holders == {"proxy", "store-init"}, holders
    for name, svc in services_by_role(project, "replica").items():
        (claims,) = mounts(svc, "claims")
        assert claims["target"] == f"{root}/.fleet" and not claims.get("read_only"), f"{name}: {claims}"
    assert {name for name, svc in project["services"].items() if mounts(svc, "claims")} == \
        set(services_by_role(project, "replica"))


def test_hf_cache_is_shared_by_trainer_and_replicas(project: dict) -> None:
    for name, svc in {**services_by_role(project, "replica"), **services_by_role(project, "trainer")}.items():
        (cache,) = mounts(svc, "hf-cache")
        assert svc["environment"]["HF_HOME"] == cache["target"], f"{name} does not use the shared HF cache"


# --- devices, health, order --------------------------------------------------------------------------------------


def test_gpu_services_reserve_gpus_and_cpu_profile_needs_none(project: dict) -> None:
    for name, svc in {**services_by_role(project, "replica"), **services_by_role(project, "trainer")}.items():
        if "gpu" in svc.get("profiles", []):
            devices = gpu_devices(svc)
            assert devices, f"{name} reserves no GPU"
            assert all(not (d.get("count") and d.get("device_ids")) for d in devices)
        else:
            assert "cpu" in svc.get("profiles", []), f"{name} is in neither the gpu nor the cpu profile"
            assert not gpu_devices(svc), f"{name} (cpu profile) reserves GPUs"


def test_gpu_replicas_claim_from_the_pool_and_trainer_uses_its_own_gpus(project: dict) -> None:
    vllm = project["services"]["vllm"]
    assert vllm["environment"]["REPLICA_DEVICE"] == "gpu"
    assert project["services"]["vllm-cpu"]["environment"]["REPLICA_DEVICE"] == "cpu"
    trainer_env = project["services"]["trainer"]["environment"]
    trainer_gpus = trainer_env["CUDA_VISIBLE_DEVICES"].split(",")
    assert trainer_gpus and all(g.isdigit() for g in trainer_gpus)
    assert trainer_env["TRAINER_GPUS"] == trainer_env["CUDA_VISIBLE_DEVICES"]  # the rank count sees what CUDA shows


def test_a_two_gpu_trainer_gets_both_gpus(render: RenderFn) -> None:
    trainer_env = render(TRAINER_GPUS="0,1", VLLM_GPUS="2,3,4,5,6,7")["services"]["trainer"]["environment"]
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == trainer_env["TRAINER_GPUS"] == "0,1"


def test_replicas_scale_from_replicas_setting(render: RenderFn) -> None:
    for count in ("1", "3"):
        project = render(REPLICAS=count)
        for name, svc in services_by_role(project, "replica").items():
            assert svc["deploy"]["replicas"] == int(count), name


def test_replicas_have_shared_memory(project: dict) -> None:
    for name, svc in services_by_role(project, "replica").items():
        assert svc.get("ipc") == "host" or int(svc.get("shm_size") or 0) >= 1 << 30, f"{name}: no shm_size/ipc"


def test_every_long_running_service_has_a_healthcheck(project: dict) -> None:
    for name, svc in project["services"].items():
        if role(svc) == "one-shot":
            continue
        check = svc.get("healthcheck") or {}
        assert not check.get("disable") and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL") and check["test"] != ["NONE"], f"{name}: {check['test']}"
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name} restart={svc.get('restart')}"


def _seconds(duration: str) -> float:
    import re

    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def test_replica_start_period_covers_model_load_and_gates_the_proxy(project: dict) -> None:
    (proxy,) = services_by_role(project, "proxy").values()
    for name, svc in services_by_role(project, "replica").items():
        start = _seconds(svc["healthcheck"]["start_period"])
        assert start >= 300, f"{name}: start_period {start}s is too short to load a model"
        # The proxy is healthy only once replicas are ready, so its grace period must cover theirs.
        assert _seconds(proxy["healthcheck"]["start_period"]) >= start


def test_trainer_starts_after_a_healthy_proxy_and_restarts_on_failure(project: dict) -> None:
    trainers = services_by_role(project, "trainer")
    assert {"trainer", "trainer-cpu"} <= set(trainers)
    for name, svc in trainers.items():
        assert svc["depends_on"]["proxy"]["condition"] == "service_healthy", name
        assert svc["restart"] == "on-failure", name


def test_one_shot_services_are_adopted_so_up_wait_succeeds(project: dict) -> None:
    """`up --wait` treats an exited container as failure unless a running service depends on its completion."""
    services = project["services"]
    for name, svc in services.items():
        if role(svc) != "one-shot":
            continue
        replicas = {"gpu": "vllm", "cpu": "vllm-cpu"}
        if svc.get("profiles") and not set(svc["profiles"]) & set(replicas):
            continue  # a tool of its own profile (the doctor): `docker compose run`, never `up`
        adopters = [
            other for other, o in services.items()
            if (o.get("depends_on") or {}).get(name, {}).get("condition") == "service_completed_successfully"
        ]
        # Adopted in every profile it runs in: by the replicas there (and the proxy, for profile-less ones).
        wanted = {replicas[p] for p in svc["profiles"]} if svc.get("profiles") else {*replicas.values(), "proxy"}
        assert wanted <= set(adopters), f"{name} is adopted by {adopters} only"


def test_cpu_profile_runs_the_same_topology(run_compose: ComposeRunner, make_env_file: EnvFileMaker) -> None:
    env_file = make_env_file()

    def services(profile: str) -> set[str]:
        result = run_compose("config", "--services", env_file=env_file, profiles=(profile,))
        assert result.returncode == 0, result.stderr
        return set(result.stdout.split())

    gpu, cpu = services("gpu"), services("cpu")
    # The same topology, plus the one-shots that build the cpu profile's default model (the offline tiny model) and
    # convert a named one (BASE_MODEL=smollm2-135m).
    assert {name.removesuffix("-cpu") for name in cpu} == gpu | {"tiny-model", "named-model"} and gpu == STACK


def test_default_profile_comes_from_env_example(run_compose: ComposeRunner, make_env_file: EnvFileMaker) -> None:
    """`docker compose up` with the documented .env starts the GPU stack, `--scale vllm=N` works without flags."""
    result = run_compose("config", "--services", env_file=make_env_file(), profiles=())
    assert set(result.stdout.split()) == STACK, result.stderr
    cpu = run_compose("config", "--services", env_file=make_env_file(COMPOSE_PROFILES="cpu"), profiles=())
    assert set(cpu.stdout.split()) == {"store-init", "proxy", "tiny-model", "named-model", "model-fetch-cpu",
                                       "vllm-cpu", "trainer-cpu"}, cpu.stderr


def test_cpu_trainer_is_the_trainer_dockerfile_on_the_cpu_replica_image(project: dict) -> None:
    """One trainer Dockerfile: FROM vllm-openai by default, FROM the vllm-cpu service's image in the cpu profile."""
    services = project["services"]
    build = services["trainer-cpu"]["build"]
    assert build["dockerfile"] == services["trainer"]["build"]["dockerfile"]
    assert build["args"]["VLLM_IMAGE"] == services["vllm-cpu"]["image"]
    assert build["args"]["TRAINER_GPU_PACKAGES"] == "", "the cpu trainer image must not pull Liger's GPU kernels"
    assert "args" not in services["trainer"]["build"], "the GPU trainer must use the Dockerfile's pinned default"


def test_builds_work_with_the_classic_builder(project: dict) -> None:
    """No BuildKit-only features on the default path: Debian's Engine 20.10 has no buildx, and `additional_contexts`
    tied `docker compose run trainer-cpu` to a rebuild of the replica image. Every RUN step's network is settable
    (BUILD_NETWORK=host where the engine has no default bridge)."""
    for name, svc in project["services"].items():
        build = svc.get("build")
        if not build:
            continue
        assert not build.get("additional_contexts"), f"{name}: additional_contexts needs BuildKit"
        assert build.get("network") == "default", f"{name}: build network {build.get('network')!r} (BUILD_NETWORK)"
    for dockerfile in REPO.glob("services/*/Dockerfile*"):
        text = dockerfile.read_text()
        assert "--mount=" not in text and "# syntax=" not in text, f"{dockerfile}: a BuildKit-only instruction"
