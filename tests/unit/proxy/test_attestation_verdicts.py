"""Attestation's verdicts (proxy attestation.py) and the report's parsing (lorafleet.engine_identity), over generated
reports: a replica attests exactly when every adapter it holds matches the ledger's reference for its group; the
first report of a group sets the reference; the ledger file keeps references and older readers' files still parse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.engine_identity import AdapterIdentity, Report, ReportError, combine, named_modules, parse_report
from lorafleet.ledger_format import Entry, LedgerState, parse, serialize
from lorafleet_proxy.attestation import compare, judge

pytestmark = pytest.mark.timeout(60)

GROUP = "vllm 0.31.0 torch.float32/torch.float32"
DIGESTS = st.sampled_from(["sha256:aa", "sha256:bb", "sha256:cc"])
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj")


def held(name: str, weights: str, slot: str | None, applied: int = 3, path: str = "/store/x") -> AdapterIdentity:
    return AdapterIdentity(name, path, weights, slot, MODULES[:applied], MODULES)


@given(weights=DIGESTS, slot=st.one_of(st.none(), DIGESTS), reference=st.one_of(st.none(), st.tuples(DIGESTS, DIGESTS)),
       applied=st.integers(0, 3))
def test_an_adapter_attests_only_as_its_reference_says(weights: str, slot: str | None,
                                                       reference: tuple[str, str] | None, applied: int) -> None:
    entry = Entry("/store/x", attested=() if reference is None else ((GROUP, *reference),))
    why, updated = compare("a", entry, GROUP, held("a", weights, slot, applied))
    if applied < len(MODULES):
        assert why is not None and f"applies {applied} of the 3" in why
        assert updated == entry
    elif reference is None:  # the first report of the group sets the reference
        assert why is None and updated.reference(GROUP) == (weights, slot or "")
    else:
        wrong = weights != reference[0] or (slot is not None and slot != reference[1])
        assert (why is not None) == wrong
        assert updated.reference(GROUP) == reference


def test_another_group_never_judges_and_another_path_always_disagrees() -> None:
    entry = Entry("/store/x", attested=(("vllm 0.26.0 torch.bfloat16/auto", "sha256:aa", "sha256:aa"),))
    why, updated = compare("a", entry, GROUP, held("a", "sha256:bb", None))
    assert why is None and updated.reference(GROUP) == ("sha256:bb", "")
    assert updated.reference("vllm 0.26.0 torch.bfloat16/auto") == ("sha256:aa", "sha256:aa")
    why, _ = compare("a", entry, GROUP, held("a", "sha256:aa", None, path="/elsewhere"))
    assert why is not None and "/elsewhere" in why


def test_a_name_the_ledger_does_not_hold_disagrees_and_an_evicted_adapter_is_not_judged() -> None:
    wanted = {"a": Entry("/store/x", attested=((GROUP, "sha256:aa", ""),)), "b": Entry("/store/y")}
    report = Report("0.31.0", "torch.float32/torch.float32", {"a": held("a", "sha256:aa", "sha256:s")})
    verdict = judge(report, {"a": "/store/x", "b": "/store/y", "stray": "/store/z"}, wanted)
    assert list(verdict.problems) == ["stray"]  # b is listed but not in the engine's cache now: not judged
    assert verdict.references["a"].reference(GROUP) == ("sha256:aa", "sha256:s")  # the slot reference was missing


def report_item(name: str, lora_id: int, weights: str) -> dict[str, Any]:
    return {"name": name, "path": "/p", "id": lora_id, "weights": weights, "slot": None, "slot_weights": None,
            "applied": list(MODULES), "named": list(MODULES)}


def test_the_newest_registration_of_a_name_is_the_one_attested_and_shards_combine() -> None:
    worker = {"format": 1, "vllm": "0.31.0", "dtype": "d", "slots": [],
              "adapters": [report_item("a", 7, "sha256:new"), report_item("a", 3, "sha256:old")]}
    assert parse_report({"results": [worker]}).adapters["a"].weights == "sha256:new"
    combined = parse_report({"results": [worker, worker]}).adapters["a"].weights
    assert combined == combine(["sha256:new", "sha256:new"])
    with pytest.raises(ReportError):
        parse_report({"results": [worker, {**worker, "adapters": []}]})


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()),
                 st.dictionaries(st.sampled_from(["results", "format"]), st.integers())))
def test_anything_but_a_report_is_a_report_error(answer: Any) -> None:
    with pytest.raises(ReportError):
        parse_report(answer if not isinstance(answer, list) else {"results": answer})


def test_references_survive_the_ledger_file_and_an_odd_attested_field_is_dropped(tmp_path: Path) -> None:
    store = tmp_path / ".content"
    digest = "sha256:" + "ab" * 32
    entry = Entry(str(store / ("ab" * 32)), digest, "default", "", ((GROUP, "sha256:w", "sha256:s"),))
    text = serialize(LedgerState({"a": entry}))
    assert parse(text, tmp_path).adapters["a"] == entry
    odd = text.replace(b'"attested": {', b'"attested": 3, "was": {')
    assert parse(odd, tmp_path).adapters["a"].attested == ()


def test_the_files_name_their_modules_from_the_safetensors_header_alone(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    keys = {f"base_model.model.{module}.lora_{side}.weight": torch.zeros(1, 1) for module in MODULES for side in "AB"}
    save_file(keys, tmp_path / "adapter_model.safetensors")
    assert named_modules(tmp_path) == tuple(sorted(MODULES))
    assert named_modules(tmp_path / "none") is None
