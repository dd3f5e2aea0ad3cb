"""`Fleet` (and `Ledger`) satisfy every protocol the proxy's modules name for them, member by member.

A module that acts on the fleet names the few actions it needs as a `typing.Protocol` of its own (sync.SyncFleet,
health.HealthFleet, broadcast.BroadcastFleet, ...; docs/development/layout.md), so it need not import fleet.py. Nothing
type-checks the tree, so this test is what holds the two together: every protocol class of the package says in its
docstring which class satisfies it (`(fleet.Fleet is one)`), and that class, built as the app builds it, has each member
with the protocol's parameter names and the same kind (a method, a coroutine, a value).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Any, Protocol

import lorafleet_proxy
import pytest
from lorafleet.settings import StackSettings
from lorafleet_proxy.app import create_app
from typing_extensions import get_protocol_members

IMPLEMENTER = re.compile(r"\((\w+)\.(\w+) is one\)")


def protocols() -> dict[str, type]:
    """Every Protocol class defined in the package, by `module.Class`."""
    found = {}
    for info in pkgutil.walk_packages(lorafleet_proxy.__path__, "lorafleet_proxy."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and value.__module__ == module.__name__
                    and getattr(value, "_is_protocol", False) and value is not Protocol):
                found[f"{module.__name__.removeprefix('lorafleet_proxy.')}.{name}"] = value
    return found


def mismatches(protocol: type, implementer: object) -> list[str]:
    """The members of `protocol` that `implementer` lacks or has with other parameters or of another kind."""
    found = []
    for member in sorted(get_protocol_members(protocol)):
        wanted = inspect.getattr_static(protocol, member, None)
        if not hasattr(implementer, member):
            found.append(f"{member}: missing")
        elif inspect.isfunction(wanted):
            have = getattr(implementer, member)
            if not callable(have):
                found.append(f"{member}: not a method")
                continue
            names = list(inspect.signature(wanted).parameters)[1:]
            if list(inspect.signature(have).parameters) != names:
                found.append(f"{member}: parameters {list(inspect.signature(have).parameters)}, not {names}")
            if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(have):
                found.append(f"{member}: {'not ' if inspect.iscoroutinefunction(wanted) else ''}a coroutine")
        elif callable(getattr(implementer, member)) and not isinstance(wanted, property):
            found.append(f"{member}: a method, where the protocol reads a value")
    return found


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = StackSettings(adapter_root=tmp_path_factory.mktemp("root"), proxy_upstreams="http://127.0.0.1:9")
    state = create_app(settings).state
    return {"fleet.Fleet": state.fleet, "ledger.Ledger": state.ledger}


FOUND = protocols()


def test_the_protocols_are_found() -> None:
    assert {"sync.SyncFleet", "health.HealthFleet", "broadcast.BroadcastFleet", "runs.registry.RunsLedger"} <= set(
        FOUND), sorted(FOUND)


@pytest.mark.parametrize("name", sorted(FOUND))
def test_its_implementer_satisfies_each_protocol(name: str, parts: dict[str, Any]) -> None:
    named = IMPLEMENTER.search(" ".join((FOUND[name].__doc__ or "").split()))
    assert named, f"{name}'s docstring names no class that satisfies it, as '(fleet.Fleet is one)'"
    implementer = f"{named[1]}.{named[2]}"
    assert implementer in parts, f"{name}: {implementer} is not one of the parts this test builds"
    assert not mismatches(FOUND[name], parts[implementer]), (name, mismatches(FOUND[name], parts[implementer]))


def test_a_member_the_fleet_lacks_is_found(parts: dict[str, Any]) -> None:
    class Planted(Protocol):
        broadcast_epoch: int
        retired: list[str]

        def ready(self) -> list[str]: ...

        def eject(self, replica: object, why: str) -> None: ...

        def judge(self, subject: str, replicas: list[object], key: object = None) -> None: ...

        def heartbeat(self) -> float: ...

    assert mismatches(Planted, parts["fleet.Fleet"]) == [
        "eject: parameters ['replica', 'error'], not ['replica', 'why']", "heartbeat: not a method",
        "judge: a coroutine", "retired: missing"]
