"""Static checks of deploy/kubernetes: every overlay rendered once per session (kubectl kustomize, no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from k8s_manifests import OVERLAYS, RUN_COMPONENT, WITH_RUN, Obj, render, with_components
from lorafleet_testing.compose_helpers import ENV_EXAMPLE, EnvEntry, parse_env_example


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every overlay, and every overlay with the named run's component (`gpu+run-b`, ...)."""
    with_run = {name: render(with_components(tmp_path_factory.mktemp(name), overlay, (RUN_COMPONENT,)))
                for name, overlay in WITH_RUN.items()}
    return {**{overlay: render(overlay) for overlay in OVERLAYS}, **with_run}


@pytest.fixture
def fresh(rendered: dict[str, list[Obj]]) -> Callable[[str], list[Obj]]:
    """`fresh(overlay)`: a deep copy of the rendering, to break on purpose."""

    def copy_of(overlay: str) -> list[Obj]:
        return copy.deepcopy(rendered[overlay])

    return copy_of


@pytest.fixture(scope="session")
def env_example() -> dict[str, EnvEntry]:
    return parse_env_example(ENV_EXAMPLE.read_text())
