"""Adapter names and `confine`: the guards every lora_name / lora_path from the outside goes through."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from lorafleet.adapters import (
    AdapterNameError,
    AdapterPathError,
    adapter_dir,
    check_adapter_name,
    confine,
    fleet_dir,
    lora_dir,
    policy_name,
    policy_version,
    run_dir,
)

# --- names ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 10, 999, 123456789])
def test_policy_name_round_trips(version: int) -> None:
    name = policy_name(version)
    assert name == f"trl-policy-v{version}"
    assert policy_version(name) == version
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("version", [0, -1])
def test_policy_versions_start_at_one(version: int) -> None:
    with pytest.raises(AdapterNameError, match="start at 1"):
        policy_name(version)


@pytest.mark.parametrize(
    "name",
    ["trl-policy-v0", "trl-policy-v01", "trl-policy-v", "trl-policy-1", "trl-policy-v1x", "xtrl-policy-v1",
     "trl-policy-v1 ", "trl-policy-v1\n", "TRL-POLICY-V1", "trl-policy-v1234567890", "my-adapter"],
)
def test_non_policy_names_have_no_version(name: str) -> None:
    assert policy_version(name) is None


@pytest.mark.parametrize("name", ["my-adapter", "a", "run1.trl-policy-v3", "A_b-9.c", "x" * 128])
def test_good_adapter_names_are_accepted(name: str) -> None:
    assert check_adapter_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", ".hidden", "-dash", "../etc", "a/b", "a\\b", "a b", "a\nb", "trl-policy-v1\n", "x" * 129, "ü", None, 3, ["a"]],
)
def test_bad_adapter_names_are_rejected_with_the_pattern(name: object) -> None:
    with pytest.raises(AdapterNameError, match=r"invalid adapter name .*must match"):
        check_adapter_name(name)


# --- layout --------------------------------------------------------------------------------------------------------


def test_store_layout() -> None:
    root = Path("/adapters")
    assert run_dir(root, "run1") == Path("/adapters/runs/run1")
    assert lora_dir(root, "run1") == Path("/adapters/runs/run1/.vllm_lora")
    assert adapter_dir(root, "run1", "trl-policy-v3") == Path("/adapters/runs/run1/.vllm_lora/trl-policy-v3")
    assert fleet_dir(root) == Path("/adapters/.fleet")
    with pytest.raises(AdapterNameError):
        adapter_dir(root, "run1", "../../etc")


# --- confine -------------------------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """An adapter root with one real adapter directory, plus a sibling directory outside the root."""
    root = tmp_path / "adapters"
    (root / "runs" / "run1" / ".vllm_lora" / "trl-policy-v1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return root


V1 = PurePosixPath("runs/run1/.vllm_lora/trl-policy-v1")


def test_a_good_absolute_path_is_returned_relative_to_the_root(store: Path) -> None:
    path = store / "runs" / "run1" / ".vllm_lora" / "trl-policy-v1"
    assert confine(path, store) == V1
    assert confine(str(path), str(store)) == V1
    assert confine(str(store), store) == PurePosixPath(".")


def test_a_relative_path_is_taken_inside_the_root(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path / "outside")  # not relative to the working directory
    assert confine("runs/run1/.vllm_lora/trl-policy-v1", store) == V1
    assert confine("./runs//run1/./.vllm_lora/trl-policy-v1/", store) == V1


def test_dotdot_that_stays_inside_is_read_as_written(store: Path) -> None:
    path = store / "runs" / "run1" / ".." / "run1" / ".vllm_lora" / "trl-policy-v1"
    assert confine(path, store) == V1


@pytest.mark.parametrize("path", ["../outside", "runs/../../outside", "runs/run1/../../../outside/x", "/..", "/"])
def test_dotdot_traversal_is_rejected(store: Path, path: str) -> None:
    with pytest.raises(AdapterPathError, match="outside the adapter root"):
        confine(path, store)


def test_absolute_path_outside_is_rejected(store: Path, tmp_path: Path) -> None:
    for path in ["/etc", str(tmp_path / "outside"), str(tmp_path / "adapters-evil")]:  # a prefix is not "inside"
        with pytest.raises(AdapterPathError, match="outside the adapter root"):
            confine(path, store)


def test_symlinks_are_never_consulted(store: Path, tmp_path: Path) -> None:
    """A symlink's name comes back as written, wherever it points: the proxy's walk opens it with O_NOFOLLOW and
    refuses it (tests/unit/proxy/test_content_store.py), so no check here could be raced."""
    lora = store / "runs" / "run1" / ".vllm_lora"
    (lora / "out").symlink_to(tmp_path / "outside")
    (lora / "latest").symlink_to(lora / "trl-policy-v1")
    assert confine(lora / "out", store) == PurePosixPath("runs/run1/.vllm_lora/out")
    assert confine(lora / "latest" / "..", store) == PurePosixPath("runs/run1/.vllm_lora")


def test_a_root_reached_through_a_symlink_confines_in_both_spellings(store: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(store)
    assert confine(alias / "runs" / "run1", alias) == PurePosixPath("runs/run1")
    assert confine(store / "runs" / "run1", alias) == PurePosixPath("runs/run1")
    with pytest.raises(AdapterPathError):
        confine(alias / ".." / "outside", alias)


@pytest.mark.parametrize("path", ["", "runs/\x00x"])
def test_empty_or_nul_paths_are_rejected(store: Path, path: str) -> None:
    with pytest.raises(AdapterPathError, match="invalid adapter path"):
        confine(path, store)


def test_errors_name_the_path_and_the_root(store: Path) -> None:
    with pytest.raises(AdapterPathError) as error:
        confine("../outside", store)
    assert "'../outside'" in str(error.value) and str(store) in str(error.value)
