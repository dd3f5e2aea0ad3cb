"""The content store (content_store.py): what replicas load is a copy only the proxy writes, named by its content.

Any set of files is copied as the fingerprint sees it, under the hex name the ledger's format defines; a symlink
planted at any component of the path after the proxy's check, or a file that is not a plain file, is refused; a swap of
the folder while the copy reads it changes nothing of the copy; a folder of that name already there is reused once it
verified; the store stays bounded over many versions and runs; a restored ledger refuses a store folder that is
missing or does not hash to its name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet.ledger_format import Entry, LedgerState, fingerprint, folder_digest
from lorafleet_proxy.content_store import ContentError, ContentStore, NoAdapter
from lorafleet_proxy.ledger import Ledger, ledger_path
from lorafleet_testing.fakes import weights_file
from test_membership import publish

SOURCE = Path("runs/r/.vllm_lora/trl-policy-v1")
FILE_NAMES = st.sampled_from(["adapter_model.safetensors", "extra.safetensors", "a.safetensors", "README.md",
                              "training_args.bin", "notes.txt"])


def defined_digest(files: dict[str, bytes]) -> str:
    """The fingerprint's hex as the ledger's format defines it, written out apart from the code: sha256 over each
    config or weights file's name, NUL, bytes, NUL, in name order."""
    digest = hashlib.sha256()
    for name in sorted(name for name in files if name == "adapter_config.json" or name.endswith(".safetensors")):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()


def make_store(root: Path, **kwargs: object) -> ContentStore:
    return ContentStore(root / ".content", root, **kwargs)  # type: ignore[arg-type]


def folders(store: ContentStore) -> set[str]:
    return {name for name in os.listdir(store.root)} if store.root.exists() else set()


@settings(max_examples=40, deadline=None)
@given(files=st.dictionaries(FILE_NAMES, st.binary(min_size=1, max_size=3000), max_size=5).filter(
    lambda files: any(name.endswith(".safetensors") for name in files)),
       config=st.binary(min_size=1, max_size=200))
def test_any_set_of_files_is_stored_as_the_fingerprint_sees_it(files: dict[str, bytes], config: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / SOURCE
        source.mkdir(parents=True)
        written = {name: weights_file(data) if name.endswith(".safetensors") else data
                   for name, data in {**files, "adapter_config.json": config}.items()}
        for name, data in written.items():
            (source / name).write_bytes(data)
        store = make_store(root)
        stored = store.ingest(str(source))
        assert stored.fingerprint == fingerprint(source) and stored.path == str(store.root / stored.fingerprint[7:])
        hex_name = defined_digest(written)
        assert Path(stored.path).name == hex_name == folder_digest(stored.path) == folder_digest(source)
        kept = {name for name in files if name.endswith(".safetensors")} | {"adapter_config.json"}
        assert set(os.listdir(stored.path)) == kept, "only what the fingerprint hashes is copied"
        assert all((Path(stored.path) / name).read_bytes() == (source / name).read_bytes() for name in kept)
        assert all(not os.access(Path(stored.path) / name, os.W_OK) or os.geteuid() == 0 for name in kept)
        assert store.ingest(str(source)) == stored and folders(store) == {Path(stored.path).name}, "not idempotent"


def test_a_folder_without_its_config_is_no_adapter_yet(tmp_path: Path) -> None:
    (tmp_path / SOURCE).mkdir(parents=True)
    with pytest.raises(NoAdapter, match="No adapter found"):
        make_store(tmp_path).ingest(str(tmp_path / SOURCE))
    with pytest.raises(NoAdapter, match="does not exist"):
        make_store(tmp_path).ingest(str(tmp_path / "runs/r/.vllm_lora/trl-policy-v9"))


def _two_runs(root: Path) -> tuple[Path, Path]:
    """Run r's published adapter and run other's, with different weights."""
    mine = publish(root / SOURCE, b"run r's published weights")
    theirs = publish(root / "runs/other/.vllm_lora/trl-policy-v1", b"the other run's weights")
    return mine, theirs


def _swap_for_symlink(path: Path, target: Path) -> None:
    """What a trainer can do to its own folder: move a directory aside and put a symlink in its place."""
    path.rename(path.with_name(path.name + ".aside"))
    path.symlink_to(target)


@pytest.mark.parametrize("depth", range(len(SOURCE.parts)))
def test_a_symlink_planted_at_any_component_after_the_check_is_refused(tmp_path: Path, depth: int) -> None:
    """Any component of runs/r/.vllm_lora/trl-policy-v1, swapped for a symlink into a tree that holds another
    adapter at the same place below it: the walk refuses it, nothing is stored."""
    mine = publish(tmp_path / SOURCE, b"run r's published weights")
    elsewhere = tmp_path / "elsewhere"
    publish(elsewhere / SOURCE, b"the other run's weights")
    _swap_for_symlink(tmp_path.joinpath(*SOURCE.parts[:depth + 1]), elsewhere.joinpath(*SOURCE.parts[:depth + 1]))
    assert fingerprint(mine) == fingerprint(elsewhere / SOURCE), "the path now reads the other adapter"
    store = make_store(tmp_path)
    with pytest.raises(ContentError, match="not a plain folder"):
        store.ingest(str(mine))
    assert folders(store) == set(), "something was stored"


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_an_adapter_file_that_is_not_a_plain_file_is_refused(tmp_path: Path, kind: str) -> None:
    mine, theirs = _two_runs(tmp_path)
    weights = mine / "adapter_model.safetensors"
    weights.unlink()
    if kind == "symlink":
        weights.symlink_to(theirs / "adapter_model.safetensors")
    else:
        os.mkfifo(weights)
    with pytest.raises(ContentError, match=r"plain file|not a regular file"):
        make_store(tmp_path).ingest(str(mine))


@pytest.mark.parametrize("stage", ["opened", "copied"])
def test_a_swap_while_the_copy_reads_changes_nothing_of_the_copy(tmp_path: Path, stage: str) -> None:
    """The folder's descriptor was opened before the swap: the copy is the published files, the store folder keeps
    them, and a load of the swapped path is refused from then on."""
    mine, theirs = _two_runs(tmp_path)
    published = fingerprint(mine)
    store = make_store(tmp_path)
    swaps: list[str] = []

    def swap(now: str) -> None:
        if now == stage and not swaps:
            swaps.append(now)
            _swap_for_symlink(mine, theirs)

    store.stage = swap
    stored = store.ingest(str(mine))
    assert swaps == [stage] and stored.fingerprint == published and fingerprint(stored.path) == published
    assert fingerprint(mine) == fingerprint(theirs) != published  # the path now shows the other run's files
    with pytest.raises(ContentError, match="not a plain folder"):
        store.ingest(str(mine))


def test_an_existing_folder_is_reused_once_verified_and_a_corrupt_one_replaced(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    mine, _ = _two_runs(tmp_path)
    stored = make_store(tmp_path).ingest(str(mine))
    weights = Path(stored.path) / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"rotten")
    restarted = make_store(tmp_path)  # a new proxy start: nothing verified yet
    assert restarted.verify(stored.path) == f"the content of its store folder {stored.path} does not hash to its name"
    with caplog.at_level(logging.ERROR, logger="lorafleet.proxy.content"):
        again = restarted.ingest(str(mine))
    assert again == stored and fingerprint(stored.path) == stored.fingerprint
    assert "content_corrupt" in caplog.text


def test_a_restored_ledger_refuses_a_missing_or_altered_store_folder(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The ledger trusts no store folder it cannot check: missing or altered, the entry is dropped saying why."""
    store = make_store(tmp_path)
    entries = {}
    for name in ("kept-v1", "missing-v1", "altered-v1"):
        one = store.ingest(str(publish(tmp_path / "runs/r/.vllm_lora" / name, name.encode())))
        entries[name] = Entry(one.path, one.fingerprint, source=str(tmp_path / "runs/r/.vllm_lora" / name))
    Ledger(ledger_path(tmp_path), tmp_path, store).commit(LedgerState(adapters=dict(entries)))
    missing, altered = Path(entries["missing-v1"].path), Path(entries["altered-v1"].path) / "adapter_config.json"
    for name in os.listdir(missing):
        (missing / name).unlink()
    missing.rmdir()
    altered.chmod(0o644)
    altered.write_text(json.dumps({"r": 2}))
    restored = Ledger(ledger_path(tmp_path), tmp_path, make_store(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lorafleet.proxy.ledger"):
        restored.restore()
    assert restored.entries() == {"kept-v1": entries["kept-v1"]}
    assert f"its store folder {missing} is missing" in caplog.text
    assert f"the content of its store folder {altered.parent} does not hash to its name" in caplog.text
    assert [entry["name"] for entry in json.loads(ledger_path(tmp_path).read_text())["adapters"]] == ["kept-v1"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=25, deadline=None)
@given(runs=st.integers(1, 4), slots=st.integers(1, 4), grace=st.integers(0, 50),
       steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=30))
def test_the_store_stays_bounded_over_many_versions_and_runs(runs: int, slots: int, grace: int,
                                                             steps: list[tuple[int, int]]) -> None:
    """Each step one run publishes its next version; its ledger keeps its newest `slots` (older ones are unloaded),
    time moves on and the collector runs. At every step the store holds the ledger's folders and, beyond them, only
    folders idle for less than the grace period; once the grace period passed, exactly the ledger's."""
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = make_store(root, grace_s=grace, clock=clock)
        ledger: dict[str, list[str]] = {f"run{n}": [] for n in range(runs)}
        last_used: dict[str, float] = {}
        for version, (pick, elapsed) in enumerate(steps, start=1):
            run = f"run{pick % runs}"
            source = publish(root / "runs" / run / ".vllm_lora" / f"trl-policy-v{version}", f"{run}{version}".encode())
            path = store.ingest(str(source)).path
            ledger[run] = [*ledger[run], path][-slots:]
            referenced = {p for paths in ledger.values() for p in paths}
            last_used[path] = clock.now
            clock.now += elapsed
            for one in referenced:
                last_used[one] = clock.now
            store.collect(referenced)
            held = {str(store.root / name) for name in folders(store)}
            recent = {p for p, at in last_used.items() if clock.now - at < grace}
            assert referenced <= held <= referenced | recent
            assert len(held) <= runs * slots + len(recent - referenced)
        clock.now += grace
        store.collect({p for paths in ledger.values() for p in paths})
        assert {str(store.root / name) for name in folders(store)} == {p for paths in ledger.values() for p in paths}


def test_a_pinned_folder_outlives_the_grace_period(tmp_path: Path) -> None:
    """A load in flight pins its folder: the collector leaves it, and the grace period starts when the load ends."""
    clock = Clock()
    store = make_store(tmp_path, grace_s=10, clock=clock)
    stored = store.ingest(str(publish(tmp_path / SOURCE, b"weights")))
    with store.pinned(stored):
        clock.now = 100
        assert store.collect([]) == []
    clock.now = 105
    assert store.collect([]) == []
    clock.now = 111
    assert store.collect([]) == [stored.path] and not Path(stored.path).exists()


def test_leftover_temporary_folders_go_at_start(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    (store.root / ".tmp-dead").mkdir(parents=True)
    Ledger(ledger_path(tmp_path), tmp_path, store).restore()
    assert folders(store) == set()


def test_a_clone_is_used_where_the_filesystem_offers_one_and_hashed_as_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's filesystem may have no FICLONE: a stand-in clones by an in-kernel copy. The store's folder is
    named by what was written."""
    import lorafleet_proxy.content_store as module

    clones: list[int] = []

    def clone(src: int, dst: int) -> bool:
        clones.append(src)
        os.copy_file_range(src, dst, os.fstat(src).st_size)
        return True

    monkeypatch.setattr(module, "_reflink", clone)
    stored = make_store(tmp_path).ingest(str(publish(tmp_path / SOURCE, b"weights")))
    assert len(clones) == 2 and stored.fingerprint == fingerprint(stored.path) == fingerprint(tmp_path / SOURCE)


def _plant(weights: Path, theirs: Path, kind: str) -> None:
    """Put `kind` of file where run r's weights were."""
    weights.unlink()
    if kind == "hard link":
        os.link(theirs / "adapter_model.safetensors", weights)
    elif kind == "device":
        try:
            os.mknod(weights, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
    elif kind == "socket":
        short = Path(tempfile.mkdtemp(prefix="s")) / "s"
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(short))
        os.rename(short, weights)
        short.parent.rmdir()
    elif kind == "empty":
        weights.write_bytes(b"")
    else:  # sparse and huge: past PROXY_ADAPTER_MAX_MB without a byte on disk
        weights.write_bytes(b"w")
        os.truncate(weights, 2 << 20)


@pytest.mark.parametrize(("kind", "why"), [("hard link", "hard links"), ("device", "not a regular file"),
                                           ("socket", "cannot be opened as a plain file"), ("empty", "is empty"),
                                           ("sparse", "PROXY_ADAPTER_MAX_MB")])
def test_a_file_a_load_may_not_copy_is_refused_naming_it(tmp_path: Path, kind: str, why: str) -> None:
    mine, theirs = _two_runs(tmp_path)
    _plant(mine / "adapter_model.safetensors", theirs, kind)
    store = make_store(tmp_path, max_bytes=1 << 20)
    with pytest.raises(ContentError, match=why) as refused:
        store.ingest(SOURCE)
    assert f"{mine}/adapter_model.safetensors" in str(refused.value)
    assert folders(store) == set(), "something was stored"


@pytest.mark.parametrize("how", ["grow", "shrink"])
def test_a_file_that_changes_while_it_is_copied_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           how: str) -> None:
    """The copy reads the file while the trainer still writes it: the fstat after the copy tells."""
    import lorafleet_proxy.content_store as module

    mine, _ = _two_runs(tmp_path)
    copy = module._copy_hashing

    def changing(src: int, dst: int, name: str, digest: object) -> int:
        if name == "adapter_model.safetensors":
            with open(mine / name, "ab" if how == "grow" else "r+b") as handle:
                handle.write(b"more") if how == "grow" else handle.truncate(3)
        return copy(src, dst, name, digest)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "_copy_hashing", changing)
    store = make_store(tmp_path)
    with pytest.raises(ContentError, match="changed while it was copied"):
        store.ingest(SOURCE)
    assert folders(store) == set()


@pytest.mark.parametrize("where", [".content", ".fleet/x", "runs/r/../../.content/00", "alias/x"])
def test_the_proxys_own_folders_are_refused_by_name_and_by_what_they_are(tmp_path: Path, where: str) -> None:
    """By name before anything is opened, and by (device, inode) for another name of the same folder."""
    publish(tmp_path / ".content/00", b"stored")
    publish(tmp_path / ".fleet/x", b"ledger's folder")
    (tmp_path / "alias").symlink_to(tmp_path / ".fleet")
    store = make_store(tmp_path)
    with pytest.raises(ContentError, match=r"the proxy's own folders|not a plain folder"):
        store.ingest(where)


@pytest.mark.parametrize("broken", [b"rotten", b"\x00" * 8, "grown", "cut"])
def test_a_weights_file_that_is_no_safetensors_file_is_refused_naming_it(tmp_path: Path, broken: bytes | str) -> None:
    """vLLM would answer the load with a 500: the tenant's file is at fault, so the store refuses it (a 400)."""
    mine, _ = _two_runs(tmp_path)
    weights = mine / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good + b"\x00" if broken == "grown" else good[:-1] if broken == "cut" else broken)
    store = make_store(tmp_path)
    with pytest.raises(ContentError, match="is not a readable safetensors file") as refused:
        store.ingest(SOURCE)
    assert f"{mine}/adapter_model.safetensors" in str(refused.value)
    assert folders(store) == set(), "something was stored"


def test_a_folder_with_its_config_and_no_weights_file_is_refused(tmp_path: Path) -> None:
    """The isolation attack's swap-file race listed the folder while its weights file was away: vLLM answers a load
    of such a copy with 500 "doesn't contain tensors"."""
    mine, _ = _two_runs(tmp_path)
    (mine / "adapter_model.safetensors").unlink()
    store = make_store(tmp_path)
    with pytest.raises(ContentError, match="no weights file"):
        store.ingest(SOURCE)
    assert folders(store) == set(), "something was stored"
