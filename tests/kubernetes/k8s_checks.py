"""The properties every rendered overlay must have. Each check returns its problems ([] = holds), so the tests can
run it on the real rendering and on a copy broken on purpose (a check that cannot fail proves nothing)."""

from __future__ import annotations

import functools
import os
import re
import tomllib
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import yaml
from k8s_manifests import (
    REPO,
    Container,
    Obj,
    config_map_data,
    containers,
    main_container,
    run_trainers,
    selects,
    workloads,
)
from lorafleet.settings import SECRET_FIELDS, StackSettings, env_name
from pydantic import ValidationError

COMPONENT = "app.kubernetes.io/component"
CONFIG = "lorafleet-config"
KEYS_SECRET = "lorafleet-keys"
# Run keys (docs/guides/kubernetes.md#a-second-run-and-run-keys): the proxy reads the runs' key hashes from this Secret,
# mounted as RUN_KEYS_DIR; each named run's trainer reads its key from the Secret lorafleet-run-<run> (key `key`),
# as TRAINER_RUN_KEY_FILE.
RUN_KEYS_SECRET = "lorafleet-run-keys"
RUN_SECRET_PREFIX = "lorafleet-run-"
RUN_SECRET_KEY = "key"
# Pod fields that make a workload's security: a named run's trainer has the base trainer's, every one.
POD_SECURITY_FIELDS = ("securityContext", "automountServiceAccountToken", "enableServiceLinks", "serviceAccountName",
                       "hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace")
# uid of the proxy image's user (services/proxy/Dockerfile); every pod runs as it.
RUN_AS = 10001
PRIVATE_RANGES = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}
SECRETS = {env_name(field) for field in SECRET_FIELDS} | {"HF_TOKEN"}
# Which components may hold each key (SECURITY.md, "Keys only where needed").
KEY_HOLDERS = {"PROXY_API_KEY": {"proxy"}, "PROXY_UPSTREAM_TOKEN": {"proxy", "replica"},
               "HF_TOKEN": {"trainer", "model-fetch"}}
# Variables the manifests set that are not lorafleet settings: read by the Hugging Face libraries, the OS, and the
# NVIDIA container runtime.
NOT_SETTINGS = {"HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN", "HOME", "NVIDIA_VISIBLE_DEVICES"}
# Settings .env.example sets for Compose that Kubernetes replaces: the scheduler gives each replica its device.
REPLACED_ON_KUBERNETES = {"VLLM_GPUS", "VLLM_CPU_SETS"}
# Compose service -> the component that plays its part on Kubernetes.
COMPOSE_ROLES = {"vllm": "replica", "proxy": "proxy", "trainer": "trainer", "model-fetch": "model-fetch"}
# Compose settings that Kubernetes expresses otherwise (CUDA_VISIBLE_DEVICES: the nvidia.com/gpu limit).
COMPOSE_ONLY = {"CUDA_VISIBLE_DEVICES"}
# Writers of the whole adapter store: the proxy's store-init, and model-fetch where it builds the model there. A
# trainer writes its own run's directory alone (subPath runs/<RUN_NAME>); its run-dir init container makes it.
ADAPTER_WRITERS = {("proxy", "store-init"), ("model-fetch", "model-fetch")}


@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def compose_default(value: str) -> str:
    """`${NAME:-default}` -> default (the value Compose uses when .env does not set it)."""
    match = re.fullmatch(r"\$\{[A-Z_]+:-(?P<default>[^}]*)\}", value)
    return match["default"] if match else value


def seconds(duration: str) -> int:
    """A Compose duration (`90s`, `15m`) in seconds."""
    match = re.fullmatch(r"(\d+)([sm])", duration)
    assert match, f"unexpected Compose duration {duration!r}"
    return int(match[1]) * (60 if match[2] == "m" else 1)


def release_tag() -> str:
    """The images' tag in the manifests: the project's version (shared/pyproject.toml)."""
    return str(tomllib.loads((REPO / "shared" / "pyproject.toml").read_text())["project"]["version"])


# --- settings ------------------------------------------------------------------------------------------------------
def environment(objects: list[Obj], container: Container) -> dict[str, str]:
    """What the container's process sees: the ConfigMap it imports, then `env` (which wins); a Secret reference
    stands for a non-empty value."""
    env: dict[str, str] = {}
    for source in container.spec.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_map_data(objects, source["configMapRef"]["name"]))
    for entry in container.spec.get("env", []):
        secret = entry.get("valueFrom", {}).get("secretKeyRef")
        env[entry["name"]] = f"<{secret['name']}/{secret['key']}>" if secret else str(entry.get("value", ""))
    return env


def validate_settings(env: dict[str, str]) -> str | None:
    """The schema's verdict on an environment (None: valid), read with nothing else from the caller's environment."""
    schema = {env_name(name): name for name in StackSettings.model_fields}
    values = {schema[name]: value for name, value in env.items() if name in schema}
    with mock.patch.dict(os.environ, {}, clear=True):
        try:
            StackSettings(_env_file=None, **values)  # type: ignore[call-arg]
        except ValidationError as exc:
            return "; ".join(f"{env_name(str(error['loc'][0])) if error['loc'] else 'settings'}: {error['msg']}"
                             for error in exc.errors())
    return None


def settings_problems(objects: list[Obj], env_example: dict[str, Any]) -> list[str]:
    """Every container's environment is valid for the schema, names only known variables, and sets what Compose
    fixes for the same role; every setting .env.example sets is configured (or replaced by the scheduler)."""
    schema = {env_name(name) for name in StackSettings.model_fields}
    problems = []
    configured: set[str] = set(config_map_data(objects, CONFIG))
    for container in containers(objects):
        env = environment(objects, container)
        configured |= set(env)
        unknown = sorted(set(env) - schema - NOT_SETTINGS)
        if unknown:
            problems.append(f"{container.where}: {unknown} are neither lorafleet settings nor known variables")
        verdict = validate_settings(env)
        if verdict:
            problems.append(f"{container.where}: the settings schema rejects its environment: {verdict}")
    services = compose()["services"]
    for service, component in COMPOSE_ROLES.items():
        fixed = {name for name, value in services[service].get("environment", {}).items() if value != ""}
        present = set(environment(objects, main_container(objects, component)))
        missing = sorted(fixed - COMPOSE_ONLY - present)
        if missing:
            problems.append(f"{component}: {missing} set by compose.yaml for `{service}` are missing from its env")
    set_for_compose = {name for name, entry in env_example.items() if not entry.commented and name in schema}
    missing = sorted(set_for_compose - REPLACED_ON_KUBERNETES - configured)
    if missing:
        problems.append(f"{missing} (set in .env.example) are configured nowhere in the manifests")
    return problems


# --- devices, mounts, resources, security --------------------------------------------------------------------------
def gpu_problems(objects: list[Obj], device: str) -> list[str]:
    """gpu: each replica has exactly one nvidia.com/gpu (limit, and request if any) and takes the scheduler's
    device; cpu: no GPU anywhere. Only replica and trainer may ask for GPUs."""
    problems = []
    replica = main_container(objects, "replica")
    env = environment(objects, replica)
    if env.get("REPLICA_DEVICE") != device:
        problems.append(f"{replica.where}: REPLICA_DEVICE is {env.get('REPLICA_DEVICE')!r}, not {device!r}")
    if env.get("REPLICA_DEVICE_ASSIGNMENT") != "scheduler":
        problems.append(f"{replica.where}: REPLICA_DEVICE_ASSIGNMENT must be scheduler (no device claims)")
    for container in containers(objects):
        resources = container.spec.get("resources", {})
        limit = resources.get("limits", {}).get("nvidia.com/gpu")
        request = resources.get("requests", {}).get("nvidia.com/gpu", limit)
        wants_gpu = device == "gpu" and not container.init and container.component in ("replica", "trainer")
        if container.component == "replica" and wants_gpu and (str(limit), str(request)) != ("1", "1"):
            problems.append(f"{container.where}: nvidia.com/gpu limit {limit!r} request {request!r}, want exactly 1")
        if not wants_gpu and (limit or request):
            problems.append(f"{container.where}: asks for nvidia.com/gpu")
    return problems


def store_mounts(container: Container) -> list[Obj]:
    """Every mount of the adapter store's claim in `container` (a trainer has two: its run's directory, the models)."""
    return [mount for mount in container.spec.get("volumeMounts", [])
            if container.volume(mount["name"]).get("persistentVolumeClaim", {}).get("claimName") == "adapters"]


def trainer_store_problems(objects: list[Obj], container: Container) -> list[str]:
    """Issue 47: a trainer mounts its own run's directory of the store (rw) and the models (ro), nothing else of it;
    its run-dir init container makes that directory and sees runs/ alone."""
    env = environment(objects, container)
    root, run = env.get("ADAPTER_ROOT"), env.get("RUN_NAME")
    want = {f"{root}/runs/{run}": (f"runs/{run}", False), f"{root}/models": ("models", True)}
    have = {m["mountPath"]: (m.get("subPath"), bool(m.get("readOnly"))) for m in store_mounts(container)}
    problems = [f"{container.where}: mounts {path} of the store as {how}, want {want.get(path)} (its run {run}'s "
                "directory rw and the models ro, nothing else)" for path, how in have.items() if want.get(path) != how]
    problems += [f"{container.where}: does not mount {path} ({how[0]}) of the store" for path, how in want.items()
                 if path not in have]
    makers = [c for c in containers([container.workload]) if c.name == "run-dir"]
    made = [(c.env_value("RUN_NAME"), [(m["mountPath"], m.get("subPath")) for m in store_mounts(c)]) for c in makers]
    if made != [(run, [(f"{root}/runs", "runs")])]:
        problems.append(f"{container.where}: no run-dir init container that makes runs/{run} with runs/ alone mounted "
                        f"(run, mounts: {made})")
    return problems


def replica_store_problems(objects: list[Obj], container: Container) -> list[str]:
    """Issue 57: a replica container (its init container too) mounts, of the adapter store, the models alone
    (read-only): no run's folder, nothing a trainer can change."""
    root = environment(objects, container).get("ADAPTER_ROOT") or "/adapters"
    have = [(m["mountPath"], m.get("subPath"), bool(m.get("readOnly"))) for m in store_mounts(container)]
    if have != [(f"{root}/models", "models", True)]:
        return [f"{container.where}: mounts {have} of the store, want its models alone, read-only"]
    return []


def content_problems(objects: list[Obj]) -> list[str]:
    """Issue 57: the content claim (the content store) is mounted at ADAPTER_ROOT/.content, writable by the proxy
    alone, read-only by every replica, by nothing else (never a trainer)."""
    problems = []
    mounted = set()
    for container in containers(objects):
        root = environment(objects, container).get("ADAPTER_ROOT") or "/adapters"
        for mount in container.spec.get("volumeMounts", []):
            if container.volume(mount["name"]).get("persistentVolumeClaim", {}).get("claimName") != "content":
                continue
            where = (container.component, container.init)
            writes = where == ("proxy", False)
            if where not in (("proxy", False), ("replica", False)):
                problems.append(f"{container.where}: mounts the content store")
            elif (mount["mountPath"], mount.get("subPath"), bool(mount.get("readOnly"))) != (f"{root}/.content", None,
                                                                                          not writes):
                problems.append(f"{container.where}: mounts the content store at {mount['mountPath']} readOnly="
                                f"{mount.get('readOnly')} (want {root}/.content, {'rw' if writes else 'ro'})")
            mounted.add(container.component)
    problems += [f"the {component} does not mount the content store" for component in ("proxy", "replica")
                 if component not in mounted]
    return problems


def mount_problems(objects: list[Obj]) -> list[str]:
    """The adapter store is read-only but for its writers and mounted at ADAPTER_ROOT, except that each trainer mounts
    its own run's directory and the models only, a replica the models alone; the content claim as content_problems
    says; the fleet claim only in the proxy, at ADAPTER_ROOT/.fleet; replicas and trainers (every run's) have a
    memory-backed, size-limited /dev/shm."""
    problems = content_problems(objects)
    trainers = [main_container(objects, "trainer"), *run_trainers(objects)]
    for container in [*(main_container(objects, name) for name in ("replica", "proxy")), *trainers]:
        if not store_mounts(container):
            problems.append(f"{container.where}: does not mount the adapter store")
    for container in trainers:
        problems += trainer_store_problems(objects, container)
    for container in containers(objects):
        if container.component == "replica":
            problems += replica_store_problems(objects, container)
        root = environment(objects, container).get("ADAPTER_ROOT")
        for mount in store_mounts(container) if container.component not in ("trainer", "replica") else []:
            if (container.component, container.name) not in ADAPTER_WRITERS and not mount.get("readOnly"):
                problems.append(f"{container.where}: mounts the adapter store writable")
            if root and (mount["mountPath"] != root or mount.get("subPath")):
                problems.append(f"{container.where}: store at {mount['mountPath']}, ADAPTER_ROOT={root}")
        for mount in container.spec.get("volumeMounts", []):
            name = mount["name"]
            claim = container.volume(name).get("persistentVolumeClaim", {}).get("claimName")
            if claim == "fleet" and (container.component != "proxy" or mount["mountPath"] != f"{root}/.fleet"):
                problems.append(f"{container.where}: mounts the fleet claim (the proxy's, at ADAPTER_ROOT/.fleet)")
            if mount["mountPath"] == "/dev/shm":
                empty = container.volume(name).get("emptyDir", {})
                if empty.get("medium") != "Memory" or not empty.get("sizeLimit"):
                    problems.append(f"{container.where}: /dev/shm is not a size-limited memory emptyDir")
    for container in [main_container(objects, "replica"), main_container(objects, "trainer"), *run_trainers(objects)]:
        if not any(mount["mountPath"] == "/dev/shm" for mount in container.mounts().values()):
            problems.append(f"{container.where}: no /dev/shm volume (PyTorch shared memory)")
    return problems


def resource_problems(objects: list[Obj]) -> list[str]:
    problems = []
    for container in containers(objects):
        resources = container.spec.get("resources", {})
        missing = [f"requests.{name}" for name in ("cpu", "memory") if name not in resources.get("requests", {})]
        missing += ["limits.memory"] if "memory" not in resources.get("limits", {}) else []
        if missing:
            problems.append(f"{container.where}: no {', '.join(missing)}")
    return problems


def security_problems(objects: list[Obj]) -> list[str]:
    """Non-root (the images' uid 10001), no privilege escalation, no capabilities, the runtime's seccomp profile:
    what the namespace's `restricted` Pod Security Standard enforces at admission."""
    problems = []
    namespaces = [obj for obj in objects if obj["kind"] == "Namespace"]
    if not namespaces or any(ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted"
                             for ns in namespaces):
        problems.append("the namespace does not enforce the restricted Pod Security Standard")
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        context = pod.get("securityContext", {})
        want = {"runAsNonRoot": True, "runAsUser": RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}}
        wrong = {key: context.get(key) for key, value in want.items() if context.get(key) != value}
        if wrong:
            problems.append(f"{workload['kind']}/{workload['metadata']['name']}: pod securityContext {wrong}")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{workload['kind']}/{workload['metadata']['name']}: mounts a service account token")
        # Service links would set PROXY_PORT=tcp://... (Service `proxy`), VLLM_PORT (`vllm`): settings vLLM reads.
        if pod.get("enableServiceLinks") is not False:
            problems.append(f"{workload['kind']}/{workload['metadata']['name']}: enableServiceLinks is not false")
    for container in containers(objects):
        context = container.spec.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False or context.get("privileged"):
            problems.append(f"{container.where}: may escalate privileges")
        if context.get("capabilities", {}).get("drop") != ["ALL"] or context.get("capabilities", {}).get("add"):
            problems.append(f"{container.where}: keeps capabilities")
        if context.get("runAsUser", RUN_AS) != RUN_AS:
            problems.append(f"{container.where}: runs as uid {context['runAsUser']}")
    return problems


def image_problems(objects: list[Obj], tag: str) -> list[str]:
    """Every image names its tag, never `latest`: the release tag of the manifests."""
    problems = []
    for container in containers(objects):
        image = container.spec["image"]
        last = image.rsplit("/", 1)[-1]
        found = last.split(":", 1)[1] if ":" in last else None
        if found != tag:
            problems.append(f"{container.where}: image {image!r} is not tagged {tag!r}")
    return problems


def secret_problems(objects: list[Obj]) -> list[str]:
    """No Secret ships with the manifests (the operator creates lorafleet-keys), no key in a ConfigMap or a literal
    env value, and each key only in the containers that need it."""
    problems = [f"Secret/{obj['metadata']['name']} is rendered: keys must come from `kubectl create secret`"
                for obj in objects if obj["kind"] == "Secret"]
    for obj in objects:
        if obj["kind"] == "ConfigMap" and SECRETS & set(obj.get("data", {})):
            problems.append(f"ConfigMap/{obj['metadata']['name']} holds {sorted(SECRETS & set(obj['data']))}")
    for container in containers(objects):
        for entry in container.spec.get("env", []):
            if entry["name"] not in SECRETS:
                continue
            reference = entry.get("valueFrom", {}).get("secretKeyRef", {})
            if "value" in entry or reference.get("name") != KEYS_SECRET or reference.get("key") != entry["name"]:
                problems.append(f"{container.where}: {entry['name']} does not come from {KEYS_SECRET}")
            if container.component not in KEY_HOLDERS[entry["name"]]:
                holders = sorted(KEY_HOLDERS[entry["name"]])
                problems.append(f"{container.where}: holds {entry['name']}, which only {holders} need")
    return problems


# --- run keys ------------------------------------------------------------------------------------------------------
def secret_mounts(container: Container) -> list[tuple[str, Obj, Obj]]:
    """(Secret name, its volume source, the mount) for every Secret the container mounts, projected ones included."""
    found = []
    for name, mount in container.mounts().items():
        volume = container.volume(name)
        sources = [volume["secret"]] if "secret" in volume else []
        sources += [source["secret"] for source in volume.get("projected", {}).get("sources", []) if "secret" in source]
        found += [(str(source.get("secretName", source.get("name"))), source, mount) for source in sources]
    return found


def secret_env(container: Container) -> list[str]:
    """The Secrets the container's environment takes values from (env secretKeyRef, envFrom secretRef)."""
    names = [entry["valueFrom"]["secretKeyRef"]["name"] for entry in container.spec.get("env", [])
             if "secretKeyRef" in entry.get("valueFrom", {})]
    sources = container.spec.get("envFrom", [])
    return names + [source["secretRef"]["name"] for source in sources if "secretRef" in source]


def run_of_secret(name: str) -> str | None:
    """The run whose key the Secret holds (lorafleet-run-<run>); None for any other Secret (the hashes included)."""
    return name[len(RUN_SECRET_PREFIX):] if name.startswith(RUN_SECRET_PREFIX) and name != RUN_KEYS_SECRET else None


def readable(mode: int, pod: Obj) -> bool:
    """Can the images' user read a Secret volume's file of this mode? The files are root's, their group the pod's
    fsGroup (which the user's processes also hold), without counting on the kubelet adding group read."""
    return bool(mode & 0o004) or (bool(mode & 0o040) and pod.get("securityContext", {}).get("fsGroup") is not None)


def _mode(source: Obj, key: str) -> int:
    item = next((item for item in source.get("items", []) if item["key"] == key), {})
    return int(item.get("mode", source.get("defaultMode", 0o644)))


def key_file(source: Obj, mount: Obj, key: str) -> str | None:
    """Where the Secret's `key` lies in the container through this mount (None: not through it)."""
    items = source.get("items")
    path = next((item["path"] for item in items if item["key"] == key), None) if items else key
    if path is None:
        return None
    if mount.get("subPath"):
        return mount["mountPath"] if mount["subPath"] == path else None
    return f"{mount['mountPath'].rstrip('/')}/{path}"


def run_key_problems(objects: list[Obj]) -> list[str]:
    """The proxy mounts the Secret of the runs' key hashes, optional (the stack starts before any named run),
    read-only, readable, whole (updates arrive) and at RUN_KEYS_DIR. Each named run's trainer mounts its own run's
    Secret, and nothing mounts one it does not need; no run key comes through env; a named run's trainer has the
    base trainer's security settings, its run's name and URL, and TRAINER_RUN_KEY_FILE naming its key's file."""
    problems = []
    proxy = main_container(objects, "proxy")
    hashes = [(source, mount) for name, source, mount in secret_mounts(proxy) if name == RUN_KEYS_SECRET]
    keys_dir = environment(objects, proxy).get("RUN_KEYS_DIR", "")
    if len(hashes) != 1:
        problems.append(f"{proxy.where}: mounts the Secret {RUN_KEYS_SECRET} {len(hashes)} times, want once at "
                        f"RUN_KEYS_DIR={keys_dir!r}")
    for source, mount in hashes:
        if mount["mountPath"] != keys_dir:
            problems.append(f"{proxy.where}: RUN_KEYS_DIR={keys_dir!r} is not where {RUN_KEYS_SECRET} is mounted "
                            f"({mount['mountPath']})")
        if source.get("optional") is not True:
            problems.append(f"{proxy.where}: the Secret {RUN_KEYS_SECRET} is not optional (the stack must start "
                            "before any named run has a key)")
        if not mount.get("readOnly"):
            problems.append(f"{proxy.where}: mounts {RUN_KEYS_SECRET} writable")
        if mount.get("subPath") or source.get("items"):
            problems.append(f"{proxy.where}: mounts part of {RUN_KEYS_SECRET} (subPath or items): a run added to "
                            "the Secret would never reach the proxy")
        mode = int(source.get("defaultMode", 0o644))
        if not readable(mode, proxy.pod):
            problems.append(f"{proxy.where}: cannot read {RUN_KEYS_SECRET}'s files as uid {RUN_AS} "
                            f"(defaultMode {mode:#o})")
    for container in containers(objects):
        for name in secret_env(container):
            if name == RUN_KEYS_SECRET or run_of_secret(name) is not None:
                problems.append(f"{container.where}: takes Secret {name} through env (it shows in kubectl "
                                "describe): a run key is a file")
        for name, _, _ in secret_mounts(container):
            is_proxy = (container.component, container.init, container.run) == ("proxy", False, None)
            if name == RUN_KEYS_SECRET and not is_proxy:
                problems.append(f"{container.where}: mounts Secret {name}, which only the proxy reads")
            run = run_of_secret(name)
            is_its_trainer = (container.component, container.init, container.run) == ("trainer", False, run)
            if run is not None and not is_its_trainer:
                problems.append(f"{container.where}: mounts Secret {name}, run {run}'s key, which only the trainer "
                                f"container of run {run} reads")
    base = main_container(objects, "trainer")
    for trainer in run_trainers(objects):
        problems += _run_trainer_problems(objects, trainer, base)
    return problems


def _run_trainer_problems(objects: list[Obj], trainer: Container, base: Container) -> list[str]:
    problems = []
    run, env = trainer.run, environment(objects, trainer)
    if trainer.component != "trainer":
        problems.append(f"{trainer.where}: run {run}'s workload is labelled {COMPONENT}={trainer.component}, not "
                        "trainer (the NetworkPolicies and the trainer's checks select on it)")
    if env.get("RUN_NAME") != run:
        problems.append(f"{trainer.where}: RUN_NAME={env.get('RUN_NAME')!r}, its run is {run!r}")
    url = urlsplit(env.get("TRAINER_VLLM_URL", ""))
    if url.path.rstrip("/") != f"/runs/{run}":
        problems.append(f"{trainer.where}: TRAINER_VLLM_URL {url.geturl()} is not run {run}'s (/runs/{run})")
    own = [(source, mount) for name, source, mount in secret_mounts(trainer) if name == f"{RUN_SECRET_PREFIX}{run}"]
    files = [path for source, mount in own if (path := key_file(source, mount, RUN_SECRET_KEY))]
    if env.get("TRAINER_RUN_KEY_FILE") not in files:
        problems.append(f"{trainer.where}: TRAINER_RUN_KEY_FILE={env.get('TRAINER_RUN_KEY_FILE')!r} is not the "
                        f"file of key {RUN_SECRET_KEY!r} of its run's Secret {RUN_SECRET_PREFIX}{run} "
                        f"(mounted there: {files})")
    for source, mount in own:
        if not mount.get("readOnly"):
            problems.append(f"{trainer.where}: mounts its run key writable")
        if source.get("optional"):
            problems.append(f"{trainer.where}: its run key's Secret is optional (the trainer would start without it)")
        if not readable(_mode(source, RUN_SECRET_KEY), trainer.pod):
            problems.append(f"{trainer.where}: cannot read its run key as uid {RUN_AS} "
                            f"(mode {_mode(source, RUN_SECRET_KEY):#o})")
    for field in POD_SECURITY_FIELDS:
        if trainer.pod.get(field) != base.pod.get(field):
            problems.append(f"{trainer.where}: pod {field} {trainer.pod.get(field)!r}, the base trainer's is "
                            f"{base.pod.get(field)!r}")
    ours = {c.name: c.spec.get("securityContext") for c in containers([trainer.workload])}
    theirs = {c.name: c.spec.get("securityContext") for c in containers([base.workload])}
    if ours != theirs:
        problems.append(f"{trainer.where}: containers' securityContext {ours}, the base trainer's {theirs}")
    return problems


# --- probes, grace periods, services, discovery --------------------------------------------------------------------
def probe_port(probe: Obj) -> int | str | None:
    for handler in ("httpGet", "tcpSocket", "grpc"):
        if handler in probe:
            return probe[handler]["port"]
    return None


def probe_problems(objects: list[Obj]) -> list[str]:
    """Long-running servers have startup, readiness and liveness probes on a port they listen on; a replica's
    startup allows Compose's REPLICA_START_PERIOD for the model load."""
    problems = []
    for container in containers(objects, init=False):
        if container.workload["kind"] == "Job":
            continue
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.spec.get(kind)
            if probe is None:
                problems.append(f"{container.where}: no {kind}")
            elif container.port(probe_port(probe) or -1) is None:
                problems.append(f"{container.where}: {kind} checks port {probe_port(probe)!r}, which it does not open")
    replica = main_container(objects, "replica").spec
    start = compose_default(compose()["services"]["vllm"]["healthcheck"]["start_period"])
    startup = replica.get("startupProbe", {})
    allowed = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if allowed < seconds(start):
        problems.append(f"replica startupProbe allows {allowed}s for the model load, Compose {start}")
    return problems


def grace_problems(objects: list[Obj]) -> list[str]:
    """Trainers (every run's) and replicas get Compose's stop_grace_period (the trainer's 90 s: finish a step,
    checkpoint)."""
    problems = []
    for service, component in (("trainer", "trainer"), ("vllm", "replica")):
        want = seconds(compose()["services"][service]["stop_grace_period"])
        holders = [main_container(objects, component), *(run_trainers(objects) if component == "trainer" else [])]
        for container in holders:
            got = container.pod.get("terminationGracePeriodSeconds")
            if got != want:
                problems.append(f"{component} ({container.where}): terminationGracePeriodSeconds {got}, Compose's "
                                f"stop_grace_period {want}s")
    return problems


def _service_target(objects: list[Obj], service: Obj, component: str) -> int | None:
    """The container port of `component` that `service` (its only port) sends to, if it selects that component."""
    container = main_container(objects, component)
    labels = container.workload["spec"]["template"]["metadata"]["labels"]
    if not selects({"matchLabels": service["spec"].get("selector", {})}, labels):
        return None
    return container.port(service["spec"]["ports"][0]["targetPort"])


def discovery_problems(objects: list[Obj]) -> list[str]:
    """The proxy discovers replicas through a headless Service on their port; the trainer reaches the proxy's fleet
    port through a Service; the public port has its own; one proxy (it owns the ledger); the PDB covers replicas."""
    problems = []
    proxy, replica, trainer = (main_container(objects, name) for name in ("proxy", "replica", "trainer"))
    proxy_env, replica_env = environment(objects, proxy), environment(objects, replica)
    host, _, port = proxy_env.get("PROXY_UPSTREAM_DNS", "").rpartition(":")
    headless = [obj for obj in objects if obj["kind"] == "Service" and obj["metadata"]["name"] == host]
    if not headless or headless[0]["spec"].get("clusterIP") != "None":
        problems.append(f"PROXY_UPSTREAM_DNS={host}:{port} is not a headless Service")
    elif not (str(headless[0]["spec"]["ports"][0]["port"]) == port == replica_env.get("REPLICA_PORT")
              == str(_service_target(objects, headless[0], "replica"))):
        problems.append(f"{host}:{port} does not lead to the replicas' REPLICA_PORT {replica_env.get('REPLICA_PORT')}")
    fleet: list[Obj] = []  # the Services the trainers (every run's) reach the proxy through
    for each in (trainer, *run_trainers(objects)):
        url = urlsplit(environment(objects, each).get("TRAINER_VLLM_URL", ""))
        found = [obj for obj in objects if obj["kind"] == "Service" and obj["metadata"]["name"] == url.hostname]
        if not found or not (found[0]["spec"]["ports"][0]["port"] == url.port
                             and str(_service_target(objects, found[0], "proxy")) == proxy_env.get("PROXY_PORT")):
            problems.append(f"{each.where}: TRAINER_VLLM_URL {url.geturl()} does not lead to the proxy's PROXY_PORT")
        fleet += found
    public = [obj for obj in objects if obj["kind"] == "Service"
              and str(_service_target(objects, obj, "proxy")) == proxy_env.get("PROXY_PUBLIC_PORT")]
    if not public or public[0] in fleet:
        problems.append("the proxy's public port has no Service of its own")
    deployment = proxy.workload
    if deployment["spec"].get("replicas") != 1 or deployment["spec"].get("strategy", {}).get("type") != "Recreate":
        problems.append("the proxy must be one pod, replaced by Recreate (it owns the ledger)")
    labels = replica.workload["spec"]["template"]["metadata"]["labels"]
    if not any(obj["kind"] == "PodDisruptionBudget" and selects(obj["spec"]["selector"], labels) for obj in objects):
        problems.append("no PodDisruptionBudget covers the replicas")
    if replica.workload["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") != "true":
        problems.append("replica pods carry no prometheus.io/scrape annotation")
    return problems


# --- network policies ----------------------------------------------------------------------------------------------
def _selector_text(selector: Obj) -> str:
    parts = [f"{key}={value}" for key, value in sorted(selector.get("matchLabels", {}).items())]
    parts += [f"{e['key']} {e['operator']} {sorted(e.get('values', []))}" for e in selector.get("matchExpressions", [])]
    return ",".join(parts) or "*"


def peer_name(peer: Obj) -> str:
    """A NetworkPolicy peer, readably: `trainer` for this namespace's trainer pods, `internet` for the public
    addresses, else its selectors."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if block["cidr"] == "0.0.0.0/0" and set(block.get("except", [])) >= PRIVATE_RANGES:
            return "internet"
        return f"ipBlock {block['cidr']} except {block.get('except', [])}"
    pod = peer.get("podSelector")
    if "namespaceSelector" not in peer and pod is not None and set(pod.get("matchLabels", {})) == {COMPONENT} \
            and not pod.get("matchExpressions"):
        return str(pod["matchLabels"][COMPONENT])
    parts = [f"ns[{_selector_text(peer['namespaceSelector'])}]"] if "namespaceSelector" in peer else []
    return "/".join([*parts, f"pod[{_selector_text(pod)}]"] if pod is not None else parts)


def _policies(objects: list[Obj], labels: dict[str, str], direction: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == "NetworkPolicy" and direction in obj["spec"].get("policyTypes", [])
            and selects(obj["spec"]["podSelector"], labels)]


def _rule_ports(rule: Obj) -> list[tuple[int | str, str]]:
    return [(port.get("port", "*"), port.get("protocol", "TCP")) for port in rule.get("ports", [])] or [("*", "*")]


def _workload_name(workload: Obj) -> str:
    return f"{workload['kind']}/{workload['metadata']['name']}"


def ingress_doors(objects: list[Obj]) -> dict[tuple[str, str], set[str]]:
    """(workload, `component:port/protocol`) of every container port -> the peers NetworkPolicies let in (`*` =
    anyone). Per workload, so that each pod of a component (every run's trainer) is held to the component's doors."""
    doors: dict[tuple[str, str], set[str]] = {}
    for container in containers(objects, init=False):
        labels = container.workload["spec"]["template"]["metadata"]["labels"]
        for port in container.spec.get("ports", []):
            number, protocol = port["containerPort"], port.get("protocol", "TCP")
            door = f"{container.component}:{number}/{protocol}"
            peers = doors.setdefault((_workload_name(container.workload), door), set())
            for policy in _policies(objects, labels, "Ingress"):
                for rule in policy["spec"].get("ingress", []):
                    if any(p in ("*", number, port.get("name")) and proto in ("*", protocol)
                           for p, proto in _rule_ports(rule)):
                        peers.update(peer_name(peer) for peer in rule.get("from", [])) if rule.get("from") \
                            else peers.add("*")
    return doors


def egress_doors(objects: list[Obj]) -> dict[tuple[str, str], set[str]]:
    """(workload, its component) -> `peer:port/protocol` NetworkPolicies let its pods connect to (`*` = anyone, any
    port)."""
    doors: dict[tuple[str, str], set[str]] = {}
    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        allowed = doors.setdefault((_workload_name(workload), labels[COMPONENT]), set())
        for policy in _policies(objects, labels, "Egress"):
            for rule in policy["spec"].get("egress", []):
                peers = [peer_name(peer) for peer in rule.get("to", [])] or ["*"]
                allowed.update(f"{peer}:{port}/{proto}" for peer in peers for port, proto in _rule_ports(rule))
    return doors


def network_problems(objects: list[Obj], ingress: dict[str, set[str]], egress: dict[str, set[str]]) -> list[str]:
    """Default deny both ways, and exactly the expected doors: every container port is in `ingress` (its allowed
    peers, maybe none) and every workload's way out in `egress`."""
    problems = []
    denies = {direction for obj in objects if obj["kind"] == "NetworkPolicy" and obj["spec"]["podSelector"] == {}
              for direction in obj["spec"].get("policyTypes", [])
              if not obj["spec"].get(direction.lower())}
    problems += [f"no default-deny NetworkPolicy for {d}" for d in ("Ingress", "Egress") if d not in denies]
    doors = ingress_doors(objects)
    for (workload, door), peers in sorted(doors.items()):
        if door not in ingress:
            problems.append(f"port {door} has no decided door (allowed in: {sorted(peers)}; {workload})")
        elif peers != ingress[door]:
            problems.append(f"port {door} lets in {sorted(peers)}, want {sorted(ingress[door])} ({workload})")
    problems += [f"port {door} is expected but nothing listens there" for door in ingress.keys()
                 - {door for _, door in doors}]
    for (workload, component), ways in sorted(egress_doors(objects).items()):
        if ways != egress.get(component):
            problems.append(f"{component} may connect to {sorted(ways)}, want {sorted(egress.get(component, set()))} "
                            f"({workload})")
    return problems


def all_problems(objects: list[Obj], device: str, ingress: dict[str, set[str]], egress: dict[str, set[str]],
                 env_example: dict[str, Any]) -> list[str]:
    return [*settings_problems(objects, env_example), *gpu_problems(objects, device), *mount_problems(objects),
            *resource_problems(objects), *security_problems(objects), *image_problems(objects, release_tag()),
            *secret_problems(objects), *probe_problems(objects), *grace_problems(objects),
            *discovery_problems(objects), *run_key_problems(objects), *network_problems(objects, ingress, egress)]

