"""tools/stage_gpu.py, the staging of the GPU tier onto an offline host, without the network: its pins, the chunks'
MANIFEST and sha256 checks, parts received in any order; and the replica's sampler setting where FlashInfer is not
staged (docs/guides/gpu-processes.md#staging-onto-an-offline-gpu-host)."""

from __future__ import annotations

import importlib.util
import os
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
from lorafleet.settings import ReplicaSettings, load_settings
from lorafleet_vllm import command
from lorafleet_vllm.command import build_launch

REPO = Path(__file__).resolve().parents[2]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stage_gpu", REPO / "tools" / "stage_gpu.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["stage_gpu"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


stage = load_tool()


def test_the_pins_come_from_the_gpu_stage_lines_of_constraints():
    text = (REPO / "constraints.txt").read_text()
    pins = stage.stage_pins(text)
    names = [stage.canonical(pin.partition("==")[0]) for pin in pins]
    assert pins[0] == "vllm==0.26.0" and all("==" in pin for pin in pins)
    assert len(names) == len(set(names)), "a package staged twice"
    main_pins = {line for line in text.splitlines() if line and not line.startswith("#")}
    for bare in ("trl", "datasets", "math-verify", "pytest-asyncio", "orjson"):
        [pin] = [pin for pin in pins if stage.canonical(pin.partition("==")[0]) == bare]
        assert pin in main_pins, f"{bare} is staged at another pin than the main one"
    assert "antlr4-python3-runtime==4.13.2" in pins and "multiprocess==0.70.19" in pins


def test_a_bare_name_needs_a_main_pin_and_some_line_is_needed():
    assert stage.stage_pins("trl==1.0\n#gpu-stage trl\n#gpu-stage vllm==0.26.0\n") == ["trl==1.0", "vllm==0.26.0"]
    with pytest.raises(stage.StageError, match="nothing pins datasets"):
        stage.stage_pins("#gpu-stage datasets\n")
    with pytest.raises(stage.StageError, match="no `#gpu-stage <pin>` lines"):
        stage.stage_pins("trl==1.0\n# a comment\n")


@pytest.fixture
def chunks(tmp_path: Path) -> list[Path]:
    """A small site tree packed and split as `pack` does: several chunk folders."""
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_bytes(os.urandom(3000))
    archive = tmp_path / "gpu-site-test.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(tree, arcname=".")
    return stage.split(archive, tmp_path / "out", 1000)


def test_each_chunk_brings_the_manifest_and_the_tool(chunks: list[Path]):
    assert [chunk.name for chunk in chunks] == [f"c{i}" for i in range(1, len(chunks) + 1)] and len(chunks) >= 3
    manifests = {(chunk / "MANIFEST").read_text() for chunk in chunks}
    assert len(manifests) == 1
    manifest = stage.Manifest.read(chunks[0])
    assert manifest.archive == "gpu-site-test" and len(manifest.parts) == len(chunks)
    for chunk in chunks:
        assert (chunk / "stage_gpu.py").read_bytes() == (REPO / "tools" / "stage_gpu.py").read_bytes()


def test_parts_received_in_any_order_extract_once_all_are_there(chunks: list[Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]):
    prefix = tmp_path / "prefix"
    for chunk in reversed(chunks[1:]):
        assert stage.receive(chunk, prefix) is None
    assert not (prefix / "site").exists()
    assert f"{len(chunks) - 1} of {len(chunks)} parts present" in capsys.readouterr().out
    site = stage.receive(chunks[0], prefix)
    assert site == prefix / "site" and (site / "pkg" / "__init__.py").stat().st_size == 3000
    assert not list((prefix / "parts").glob("*.part.*")), "parts kept after extraction"
    assert stage.receive(chunks[1], prefix) == site  # again: nothing to do
    assert "already extracted" in capsys.readouterr().out


def test_a_corrupt_or_missing_part_is_refused(chunks: list[Path], tmp_path: Path):
    part = next(chunks[0].glob("*.part.*"))
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(stage.StageError, match=r"corrupt \(sha256 differs"):
        stage.receive(chunks[0], tmp_path / "prefix")
    part.unlink()
    with pytest.raises(stage.StageError, match="holds none of the parts"):
        stage.receive(chunks[0], tmp_path / "prefix")
    (chunks[1] / "MANIFEST").unlink()
    with pytest.raises(stage.StageError, match="no MANIFEST"):
        stage.receive(chunks[1], tmp_path / "prefix")


def test_joined_parts_that_miss_the_archives_sha256_are_refused(chunks: list[Path], tmp_path: Path):
    manifest = stage.Manifest.read(chunks[0])
    wrong = stage.Manifest(manifest.archive, "0" * 64, manifest.parts).text()
    for chunk in chunks:
        (chunk / "MANIFEST").write_text(wrong)
        if chunk != chunks[-1]:
            stage.receive(chunk, tmp_path / "prefix")
    with pytest.raises(stage.StageError, match="do not match the MANIFEST's sha256"):
        stage.receive(chunks[-1], tmp_path / "prefix")
    assert not (tmp_path / "prefix" / "site").exists()


def test_console_scripts_of_the_site_tree_run_with_the_venvs_python(tmp_path: Path):
    site, bin_dir = tmp_path / "site", tmp_path / "venv" / "bin"
    (site / "tool-1.0.dist-info").mkdir(parents=True)
    (site / "tool-1.0.dist-info" / "entry_points.txt").write_text(
        "[console_scripts]\ntool = tool.cli.main:main\n\n[other]\nx = y:z\n")
    bin_dir.mkdir(parents=True)
    stage.write_scripts(site, bin_dir / "python")
    script = (bin_dir / "tool").read_text()
    assert script.startswith(f"#!{bin_dir / 'python'}\n") and "from tool.cli.main import main" in script
    assert os.access(bin_dir / "tool", os.X_OK) and not (bin_dir / "x").exists()
    # Imported again by a spawned child (vLLM's engine core), the script must not run main() a second time.
    assert script.endswith('if __name__ == "__main__":\n    sys.exit(main())\n')


def test_install_refuses_a_folder_that_is_not_the_checkout(tmp_path: Path):
    with pytest.raises(stage.StageError, match="is not the lorafleet checkout"):
        stage.install_tree(Path(sys.executable), tmp_path)


def test_check_lists_every_missing_module_at_once(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(stage, "MODULES", ("json", "no_such_module_a", "no_such_module_b"))
    assert not stage.check(Path(sys.executable))
    out = capsys.readouterr().out
    assert "missing: no_such_module_a (ModuleNotFoundError" in out and "missing: no_such_module_b" in out
    assert "1 of 3 modules import" in out


@pytest.mark.parametrize(("installed", "device", "expected"), [
    (False, "gpu", {"VLLM_USE_FLASHINFER_SAMPLER": "0"}), (True, "gpu", {}), (False, "cpu", {}),
])
def test_the_replica_turns_flashinfers_sampler_off_where_flashinfer_is_missing(
        monkeypatch: pytest.MonkeyPatch, installed: bool, device: str, expected: dict[str, str]):
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        return real("json") if installed else None if name == "flashinfer" else real(name, package)

    monkeypatch.setattr(command.importlib.util, "find_spec", find_spec)
    settings = load_settings(ReplicaSettings, replica_device=device, vllm_cpu_executor="mp")
    env = build_launch(settings, "0").environment({})
    assert {key: env[key] for key in env if key == "VLLM_USE_FLASHINFER_SAMPLER"} == expected
    if expected:  # an operator's own setting wins
        assert build_launch(settings, "0").environment({"VLLM_USE_FLASHINFER_SAMPLER": "1"})[
            "VLLM_USE_FLASHINFER_SAMPLER"] == "1"

