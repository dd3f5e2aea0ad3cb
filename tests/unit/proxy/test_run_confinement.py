"""A run loads adapters only from its own folder (runs/confinement.py and the content store's walk), whatever form
the path takes.

The tree below has each kind of trap a run could use to reach another run's weights: another run's adapter and
checkpoint, symlinks into them (absolute and relative), a symlink out of the root, a run folder that is itself a
symlink to another run's, a folder whose name starts like the run's (`bb` beside `b`), and names that look
URL-encoded (neither the proxy nor vLLM decodes them: they are literal names). Every anchor's folder as written and
whether a symlink lies on its way are written down by hand; hypothesis writes each anchor in many forms (absolute,
relative, `./`, doubled slashes, detours through `..` and other folders, out of the root and back in, trailing
slashes) and the route's rule plus the store's walk must read exactly the anchors in a folder the run may load from
with no symlink on the way (each folder's config is its own name, so the fingerprint says which folder was read),
and answer the rest with a refusal before any byte is stored.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet.ledger_format import fingerprint
from lorafleet.run_key_store import provision
from lorafleet.runs import DEFAULT_RUN
from lorafleet.settings import StackSettings, load_settings
from lorafleet_proxy.app import create_app
from lorafleet_proxy.content_store import ContentError, ContentStore, NoAdapter
from lorafleet_proxy.runs.confinement import OutsideRunFolder, confine_load, load_folders
from lorafleet_testing.fakes import weights_file

NON_RUN = "<non-run>"  # an anchor in the root's non-run part (models/, ...)
# anchor (relative to the root) -> (the folder under runs/ it names as written, no symlink on the way)
ANCHORS = {
    "runs/a/.vllm_lora/trl-policy-v1": ("a", True),
    "runs/a/checkpoint-4": ("a", True),
    "runs/a": ("a", True),
    "runs/b/.vllm_lora/trl-policy-v1": ("b", True),
    "runs/b/.vllm_lora/not-published-yet": ("b", True),
    "runs/b/.vllm_lora/to-a": ("b", False),  # absolute symlink to a's adapter
    "runs/b/rel-to-a": ("b", False),  # relative symlink to a's checkpoint
    "runs/b/out": ("b", False),  # symlink out of the root
    "runs/b/.vllm_lora/%2e%2e/%2e%2e/a": ("b", True),  # literal names in b's folder, not `..`
    "runs%2Fa%2F.vllm_lora": (NON_RUN, True),  # one literal name at the root
    "runs/bb/.vllm_lora/x": ("bb", True),
    "runs/c/.vllm_lora/trl-policy-v1": ("c", False),  # runs/c is a symlink to runs/a
    "runs/run1/.vllm_lora/trl-policy-v1": ("run1", True),
    "models/tiny": (NON_RUN, True),
}
DETOURS = ["", "./", "runs/../", "runs/b/../../", "models/tiny/../../", "runs/c/../../", "../{root}/"]
PLAIN = ["runs/a/.vllm_lora/trl-policy-v1", "runs/a/checkpoint-4", "runs/b/.vllm_lora/trl-policy-v1",
         "runs/b/.vllm_lora/%2e%2e/%2e%2e/a", "runs%2Fa%2F.vllm_lora", "runs/bb/.vllm_lora/x",
         "runs/run1/.vllm_lora/trl-policy-v1", "models/tiny"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("confinement").resolve()
    root, outside = base / "adapters", base / "elsewhere"
    for folder in PLAIN:
        (root / folder).mkdir(parents=True)
        (root / folder / "adapter_config.json").write_text(folder)  # its fingerprint names the folder
        (root / folder / "adapter_model.safetensors").write_bytes(weights_file(folder.encode()))
    (root / "runs/b/.vllm_lora/not-published-yet").mkdir(parents=True)
    (outside / "x").mkdir(parents=True)
    (root / "runs/b/.vllm_lora/to-a").symlink_to(root / "runs/a/.vllm_lora/trl-policy-v1")
    (root / "runs/b/rel-to-a").symlink_to("../a/checkpoint-4")
    (root / "runs/b/out").symlink_to(outside / "x")
    (root / "runs/c").symlink_to(root / "runs/a")
    return root


def written(root: Path, anchor: str, absolute: bool, detour: str, doubled: bool, trailing: str) -> str:
    """`anchor` in one of the forms a client could send."""
    body = detour.format(root=root.name) + anchor
    if doubled:
        body = body.replace("/", "//")
    return (f"{root}/" if absolute else "") + body + trailing


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("run", "keyed", "presented", "allowed"), [
    ("b", None, None, {"b"}),  # a named run: its folder, keys or not
    ("c", None, None, {"c"}),  # a run folder that is a symlink to another run's opens nothing
    (DEFAULT_RUN, None, None, None),  # no run keys: the default run anywhere under the root, as before
    (DEFAULT_RUN, {"a", "b"}, None, {"run1"}),  # run keys: RUN_NAME's folder
    (DEFAULT_RUN, {"a", "b"}, "b", {"run1", "b"}),  # and the folder of the run whose key it presents
    (DEFAULT_RUN, {"run1"}, None, set()),  # RUN_NAME is a keyed run's: the keyless default run has no folder
])
@settings(deadline=None)
@given(anchor=st.sampled_from(sorted(ANCHORS)), absolute=st.booleans(), detour=st.sampled_from(DETOURS),
       doubled=st.booleans(), trailing=st.sampled_from(["", "/", "/."]))
def test_a_run_reads_exactly_its_own_plain_folders_whatever_the_path_form(
        root: Path, run: str, keyed: set[str] | None, presented: str | None, allowed: set[str] | None,
        anchor: str, absolute: bool, detour: str, doubled: bool, trailing: str) -> None:
    path = written(root, anchor, absolute, detour, doubled, trailing)
    folders = load_folders(run, "run1", keyed, presented)
    assert (folders is None) == (allowed is None) and (folders is None or set(folders) == allowed)
    owner, plain = ANCHORS[anchor]
    store = ContentStore(root / ".content", root)
    if allowed is not None and owner not in allowed:
        with pytest.raises(OutsideRunFolder, match=r"outside the folder of run x .* a run loads adapters only from its "
                           r"own folder ADAPTER_ROOT/runs/<run>/, never another run's adapters or checkpoints"):
            confine_load(path, root, folders, "run x")
        return
    relative = confine_load(path, root, folders, "run x")
    assert relative.as_posix() == anchor
    if not plain:
        with pytest.raises(ContentError, match="is not a plain folder"):
            store.ingest(relative)
    elif anchor in PLAIN:
        assert store.ingest(relative).fingerprint == fingerprint(root / anchor)
    else:
        with pytest.raises(NoAdapter):
            store.ingest(relative)


@pytest.mark.timeout(60)
def test_the_refusal_names_the_folder_and_keeps_the_path_as_given(root: Path) -> None:
    with pytest.raises(OutsideRunFolder) as refused:
        confine_load("runs/a/../b/../a/checkpoint-4", root, ["b"], "run 'b'")
    message = str(refused.value)
    assert f"{root}/runs/b/" in message and "'runs/a/../b/../a/checkpoint-4'" in message
    with pytest.raises(ContentError) as walked:
        ContentStore(root / ".content", root).ingest(confine_load("runs/b/rel-to-a", root, ["b"], "run 'b'"))
    assert "runs/b/rel-to-a" in str(walked.value)
    assert "checkpoint-4" not in str(walked.value), "the refusal does not reveal where another run's symlink points"
    with pytest.raises(OutsideRunFolder, match="none on this fleet"):
        confine_load("runs/run1", root, [], "the default run")


# --- the route: a vLLM-style 4xx before anything changes ------------------------------------------------------------
def settings_for(root: Path, **overrides: object) -> StackSettings:
    return load_settings(adapter_root=str(root), proxy_upstreams="http://127.0.0.1:9", run_name="run1", **overrides)


async def load(app: object, path: str, run: str = DEFAULT_RUN, key: str = "") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    prefix = "" if run == DEFAULT_RUN else f"/runs/{run}"
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        return await client.post(f"{prefix}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path},
                                 headers={"Authorization": f"Bearer {key}"} if key else {})


async def test_a_cross_run_load_is_a_403_in_vllms_body_and_reaches_no_replica(root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    minted = {run: provision(keys, run) for run in ("a", "b")}
    app = create_app(settings_for(root, run_keys_dir=str(keys)))
    for run, path, key in [("b", f"{root}/runs/a/checkpoint-4", minted["b"]),
                           ("b", "runs/b/../a/checkpoint-4", minted["b"]),
                           (DEFAULT_RUN, "runs/a/.vllm_lora/trl-policy-v1", ""),
                           (DEFAULT_RUN, "runs/a/.vllm_lora/trl-policy-v1", minted["b"])]:
        answer = await load(app, path, run, key)
        assert answer.status_code == 403, (run, path, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "Forbidden" and error["param"] == "lora_path" and error["code"] == 403
        assert "a run loads adapters only from its own folder ADAPTER_ROOT/runs/<run>/" in error["message"]
    outside = await load(app, "/etc", "b", minted["b"])
    assert outside.status_code == 400 and "outside the adapter root" in outside.json()["error"]["message"]
    assert app.state.metrics.registry.get_sample_value("lorafleet_proxy_broadcasts_total",
                                                       {"op": "load", "outcome": "ok"}) == 0
    assert not app.state.ledger.entries() and all(not r.held for r in app.state.fleet.replicas.values())


async def test_allowed_loads_pass_the_rule(root: Path, tmp_path: Path) -> None:
    """A run's own folder, and the default run with a run's key in that run's folder (the doctor's probe), get past
    the rule: the load goes on to the replicas (none answers here: 503, not a refusal)."""
    keys = tmp_path / "keys"
    minted = {run: provision(keys, run) for run in ("a", "b")}
    app = create_app(settings_for(root, run_keys_dir=str(keys)))
    for run, path, key in [("b", "runs/b/.vllm_lora/trl-policy-v1", minted["b"]),
                           (DEFAULT_RUN, "runs/run1/.vllm_lora/trl-policy-v1", ""),
                           (DEFAULT_RUN, "runs/b/.vllm_lora/trl-policy-v1", minted["b"])]:
        answer = await load(app, path, run, key)
        assert answer.status_code == 503 and "no ready replica" in answer.text, (run, path, answer.text)
    single = create_app(settings_for(root))  # no run keys: the default run anywhere under the root, as before
    assert (await load(single, "runs/a/checkpoint-4")).status_code == 503
    assert (await load(single, "runs/a/checkpoint-4", "b")).status_code == 403  # a named run: its folder only
