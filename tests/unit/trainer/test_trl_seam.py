"""The seam with TRL (trl_seam.py) against TRL's installed source: every name a patch or an override relies on is
there (a failure names it), and no trainer module outside the seam assigns onto TRL's objects."""

from __future__ import annotations

import ast
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from lorafleet_trainer import trl_seam
from lorafleet_trainer.trl_seam import OVERRIDES, PATCHES, Expects

pytestmark = pytest.mark.timeout(180)  # TRL's imports take seconds on a loaded box
PACKAGE = Path(trl_seam.__file__).parent
EXPECTED = [(patch.function, expects) for patch in PATCHES for expects in patch.expects] + list(OVERRIDES)


@pytest.mark.parametrize(("user", "expects"), EXPECTED, ids=[f"{user}:{e.name}" for user, e in EXPECTED])
def test_the_installed_trl_has_what_each_patch_expects(user: str, expects: Expects) -> None:
    missing = expects.missing()
    assert missing is None, f"{user} relies on {missing} (written against TRL {trl_seam.TRL_VERSION})"


def test_the_seam_was_written_against_the_pinned_trl() -> None:
    pinned = next(line.split("==")[1].strip() for line in (PACKAGE.parents[2] / "constraints.txt").read_text()
                  .splitlines() if line.startswith("trl=="))
    assert trl_seam.TRL_VERSION == pinned == version("trl"), "re-check every patch in trl_seam.PATCHES, then the pin"


def test_every_patch_names_a_function_of_the_seam_with_its_reasons() -> None:
    for patch in PATCHES:
        assert callable(getattr(trl_seam, patch.function, None)), patch.function
        assert patch.reason and patch.no_hook and patch.target.startswith("trl."), patch.function


def _patched_names() -> set[str]:
    """The attribute each patch assigns: the last name of its target."""
    return {name.strip(" .") for patch in PATCHES for name in patch.target.rsplit(".", 1)[1].split(",")}


def test_no_trainer_module_outside_the_seam_assigns_what_the_seam_patches() -> None:
    names = _patched_names()
    assert {"_save_checkpoint", "_loop_kwargs", "rollout_queue", "requests", "compute_loss"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "trl_seam.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                while isinstance(target, ast.Subscript):  # worker._loop_kwargs[...] = ...
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr in names:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{target.attr}")
    assert not found, f"patches of TRL outside trl_seam.py: {found}"


def test_a_name_trl_lacks_is_reported_by_name(tmp_path, monkeypatch) -> None:
    """The check can fail: a module without the attribute, and a method that no longer assigns it, are named."""
    (tmp_path / "seam_probe.py").write_text("class Worker:\n    def __init__(self):\n        self._renamed = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = Expects("seam_probe", "Worker._loop_cls").missing()
    assert missing == "seam_probe.Worker._loop_cls: TRL has no '_loop_cls' there"
    assert "no longer assigns self._loop_kwargs" in Expects("seam_probe", "_loop_kwargs", "Worker.__init__").missing()
    assert Expects("seam_probe", "_renamed", "Worker.__init__").missing() is None
    sys.modules.pop("seam_probe", None)
