"""Fixtures every test tier shares."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
from hypothesis import settings

# Property tests run beside real replicas and image builds on a 2-core box: a per-example deadline measures the
# box's load, not the code (a 400 ms example next to a building image), so examples have none; every test keeps
# pytest-timeout's bound.
settings.register_profile("lorafleet", deadline=None)
settings.load_profile("lorafleet")


@pytest.fixture(scope="session")
def debian_tool() -> Callable[[str], str]:
    """`debian_tool(name)`: the path of a binary tools/setup_system.sh installs (prometheus, promtool, wrk).

    Missing on a developer's machine: the test is skipped. Missing on CI (CI=true): the test fails, so CI
    can never pass by skipping what it is meant to prove.
    """

    def find(name: str) -> str:
        path = shutil.which(name)
        if path is None:
            message = f"{name} is not installed: run tools/setup_system.sh (Debian package prometheus/wrk)"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        return path

    return find
