"""Named models: BASE_MODEL=smollm2-135m resolves to one converted folder everywhere, and the folder is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lorafleet.named_models import MODEL_MARKER, NAMED_MODELS, SMOLLM2_135M, model_folder, resolve_base_model
from lorafleet.settings import ConfigError, load_settings
from lorafleet_ops import base_model, gguf_convert
from lorafleet_ops.gguf_convert import ModelError, file_sha256, folder_digest, make_named_model


def converted(cache: Path, name: str = SMOLLM2_135M.name) -> Path:
    folder = model_folder(cache, name)
    folder.mkdir(parents=True)
    (folder / MODEL_MARKER).write_text("{}")
    return folder


def test_a_named_model_is_its_folder_in_model_cache_for_every_service(tmp_path):
    folder = converted(tmp_path)
    settings = load_settings(base_model="smollm2-135m", model_cache=str(tmp_path))
    assert settings.base_model == str(folder)
    assert resolve_base_model("Qwen/Qwen2.5-Math-1.5B", tmp_path) == "Qwen/Qwen2.5-Math-1.5B"  # others: untouched
    assert resolve_base_model(str(folder), tmp_path) == str(folder)


def test_a_named_model_not_converted_yet_is_refused_naming_base_model_and_the_command(tmp_path):
    with pytest.raises(ConfigError, match=r"BASE_MODEL.*lorafleet make-model smollm2-135m"):
        load_settings(base_model="smollm2-135m", model_cache=str(tmp_path))
    model_folder(tmp_path, "smollm2-135m").mkdir(parents=True)  # a conversion that died: no marker
    with pytest.raises(ValueError, match=r"has no lorafleet-model\.json"):
        resolve_base_model("smollm2-135m", tmp_path)


def test_the_installed_wheel_carries_the_pinned_gguf():
    path = gguf_convert.gguf_path(SMOLLM2_135M)  # checks the sha256 itself
    assert path.name == SMOLLM2_135M.gguf and file_sha256(path) == SMOLLM2_135M.gguf_sha256


def test_the_folder_digest_covers_every_file_but_the_marker(tmp_path):
    (tmp_path / "a.json").write_text("1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"\0" * 10)
    first = folder_digest(tmp_path)
    (tmp_path / MODEL_MARKER).write_text("{}")
    assert folder_digest(tmp_path) == first
    (tmp_path / "sub" / "b.bin").write_bytes(b"\1" * 10)
    assert folder_digest(tmp_path) != first


def fake_convert(model, out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"weights")


def test_a_conversion_with_the_wrong_digest_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert", fake_convert)
    monkeypatch.setitem(NAMED_MODELS, "smollm2-135m", SMOLLM2_135M.__class__(
        **{**SMOLLM2_135M.__dict__, "folder_sha256": "0" * 64}))
    with pytest.raises(ModelError, match="expected 0000"):
        make_named_model("smollm2-135m", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_appears_whole_with_its_marker_and_is_not_redone(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert", fake_convert)
    monkeypatch.setitem(NAMED_MODELS, "smollm2-135m", SMOLLM2_135M.__class__(
        **{**SMOLLM2_135M.__dict__, "folder_sha256": ""}))
    folder = make_named_model("smollm2-135m", tmp_path)
    marker = json.loads((folder / MODEL_MARKER).read_text())
    assert marker["folder_sha256"] == folder_digest(folder) and [p.name for p in tmp_path.iterdir()] == [folder.name]
    monkeypatch.setattr(gguf_convert, "convert", None)  # converted: not called again
    assert make_named_model("smollm2-135m", tmp_path) == folder
    with pytest.raises(ModelError, match="not a named model"):
        make_named_model("gpt-9", tmp_path)


def test_the_demo_gives_a_tasks_common_defaults_to_every_process_and_resolves_the_model_itself():
    env = base_model.common_env({"base_model": "smollm2-135m", "lora_rank": 8, "learning_rate": 2e-4,
                                 "max_model_len": 512})
    assert env == {"LORA_RANK": "8", "MAX_MODEL_LEN": "512"}  # the trainer's own settings stay the trainer's
    assert base_model.prepare("/models/mine", Path("/unused")) == "/models/mine"
