"""The trainer's published adapters are readable by the proxy, which copies them as another user (Compose)."""

from __future__ import annotations

import os
import stat
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_testing.stub_http import JsonStub
from lorafleet_trainer.published_files import fleet_readable, readable_before_load
from safetensors.torch import save_file


def test_safetensors_writes_a_file_only_its_owner_reads(tmp_path: Path) -> None:
    """The premise: without the trainer's help the proxy (another uid) could not read the weights."""
    old = os.umask(0o022)
    try:
        save_file({"w": torch.zeros(2)}, str(tmp_path / "adapter_model.safetensors"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "adapter_model.safetensors").stat().st_mode) & 0o044 == 0


@settings(max_examples=50, deadline=None)
@given(modes=st.lists(st.integers(min_value=0o400, max_value=0o777), min_size=1, max_size=4))
def test_every_file_becomes_readable_and_keeps_its_other_bits(tmp_path_factory: pytest.TempPathFactory,
                                                               modes: list[int]) -> None:
    folder = tmp_path_factory.mktemp("adapter")
    for index, mode in enumerate(modes):
        path = folder / f"f{index}"
        path.write_bytes(b"x")
        path.chmod(mode)
    outside = tmp_path_factory.mktemp("outside") / "secret"
    outside.write_bytes(b"s")
    outside.chmod(0o600)
    (folder / "link").symlink_to(outside)

    fleet_readable(folder)

    for index, mode in enumerate(modes):
        assert stat.S_IMODE((folder / f"f{index}").stat().st_mode) == mode | 0o444
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600, "a symlink's target is not touched"


def test_a_folder_that_is_not_there_is_left_to_the_load_to_report(tmp_path: Path) -> None:
    fleet_readable(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    fleet_readable(tmp_path / "file")


def test_trls_load_request_goes_out_after_the_files_are_readable(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    monkeypatch.setattr(VLLMClient, "load_lora_adapter", VLLMClient.load_lora_adapter)  # restored after the test

    weights = tmp_path / "adapter_model.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    seen: list[tuple[str, int]] = []

    class Proxy(JsonStub):
        def do_POST(self) -> None:
            body = self.json_body()
            seen.append((self.path, stat.S_IMODE(Path(body["lora_path"], weights.name).stat().st_mode)))
            self.answer({})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    readable_before_load()
    readable_before_load()  # idempotent: one wrapper, not two
    try:
        client = VLLMClient.__new__(VLLMClient)
        client.server_url = f"http://127.0.0.1:{server.server_port}"
        client.load_lora_adapter("trl-policy-v1", str(tmp_path))
    finally:
        server.shutdown()
    assert seen == [("/v1/load_lora_adapter", 0o644)]
