"""Static checks of deploy/kubernetes: every overlay rendered once per session (kubectl kustomize, no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from k8s_manifests import OVERLAYS, Obj, render
from lorafleet_testing.compose_helpers import ENV_EXAMPLE, EnvEntry, parse_env_example


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.fixture
def fresh(rendered: dict[str, list[Obj]]) -> Callable[[str], list[Obj]]:
    """`fresh(overlay)`: a deep copy of the rendering, to break on purpose."""

    def copy_of(overlay: str) -> list[Obj]:
        return copy.deepcopy(rendered[overlay])

    return copy_of


@pytest.fixture(scope="session")
def env_example() -> dict[str, EnvEntry]:
    return parse_env_example(ENV_EXAMPLE.read_text())
