"""The probe: publish an adapter, load it through the proxy, generate with it on every replica, unload and
delete it, then pause and resume through the proxy, observing each step on each replica directly, or
through the proxy for a replica only the proxy can reach (`via_proxy`).

It changes the fleet for a few seconds (one LoRA slot, two pauses), so the CLI runs it on a fleet
that is training only when asked (see `runner.training`). It always cleans up, and never deletes
the files of an adapter a replica still holds (vLLM's engine dies when it re-reads them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil

import httpx
from lorafleet.ledger_format import FINGERPRINT_PREFIX, fingerprint
from lorafleet.logs import log_event
from lorafleet.runs import BUDGET_ERROR
from lorafleet.settings import StackSettings
from lorafleet.vllm_api import PauseMode, VLLMClient, VLLMError

from lorafleet_ops.commands.doctor.fleet_checks import norm_path
from lorafleet_ops.commands.doctor.gather import api_client
from lorafleet_ops.commands.doctor.model import CHANGING, ProbeReport, Snapshot
from lorafleet_ops.commands.doctor.probe_adapter import base_model_config, publish_probe_adapter
from lorafleet_ops.commands.doctor.via_proxy import ProxiedReplica, generate_through_proxy

log = logging.getLogger("lorafleet.doctor")

Replica = VLLMClient | ProxiedReplica  # a replica asked directly, or one only the proxy reaches

PROBE_PROMPT = "the red fox"
# Looks at the replicas while another client keeps pausing or resuming the fleet, before giving up on one that holds:
# up to 2 s, since a broadcast still on its way took longer than 3 looks (0.6 s) on a 2-core machine at load 25 (CI's
# doctor-beside-pausers test); a healthy fleet answers at the first look, a replica the broadcast missed still fails.
OBSERVE_TRIES = 10
OBSERVE_PAUSE_S = 0.2
UNREAD = object()  # the proxy's pause state could not be read
PROBE_GENERATE_TIMEOUT_S = 120.0


async def run_probe(settings: StackSettings, snapshot: Snapshot, http: httpx.AsyncClient | None = None) -> ProbeReport:
    """Publish, load (through the proxy when there is one), generate on every replica (directly, or through the
    proxy for one only it reaches), unload, delete; then pause and resume through the proxy. Always cleans up."""
    report = ProbeReport(broadcast=snapshot.proxy_error is None)
    replicas = snapshot.reachable()  # the unreachable ones already fail lora_enabled
    if not replicas:
        report.skipped = "no reachable replica to probe"
        return report
    token = settings.proxy_upstream_token
    fleet = api_client(snapshot.fleet_url, snapshot.fleet_token, http) if snapshot.fleet_url else None
    clients: dict[str, Replica] = {r.url: ProxiedReplica(r.url, fleet) if r.via_proxy and fleet is not None
                                   else api_client(r.url, token, http) for r in replicas}
    proxy = fleet if report.broadcast else None
    try:
        await _probe_adapter(settings, snapshot, report, clients, proxy)
        if proxy is not None:
            await _probe_pause(report, clients, proxy)
    finally:
        for direct in clients.values():
            await direct.aclose()
        if fleet is not None:
            await fleet.aclose()
    return report


async def _listed(direct: Replica, name: str, report: ProbeReport) -> bool | str:
    """Whether `direct` lists the probe at its folder (a direct load) or at its content-store folder (the proxy's)."""
    try:
        return norm_path((await direct.loaded_adapters()).get(name, "")) in {norm_path(report.path), report.served}
    except VLLMError as exc:
        return str(exc)


async def _paused(direct: Replica) -> bool | str:
    try:
        return await direct.is_paused()
    except VLLMError as exc:
        return str(exc)


async def _generate(direct: VLLMClient, name: str) -> str | None:
    body = {"model": name, "prompt": PROBE_PROMPT, "max_tokens": 2, "temperature": 0.0}
    try:
        answer = await direct.completions(body, timeout=PROBE_GENERATE_TIMEOUT_S)
    except VLLMError as exc:
        return str(exc)
    return None if answer.get("choices") else f"no choices in {answer}"


async def _generate_all(snapshot: Snapshot, clients: dict[str, Replica], name: str) -> dict[str, str | None]:
    """Generate with `name` on each replica: directly, or through the proxy until each proxied one answered."""
    direct = {url: client for url, client in clients.items() if isinstance(client, VLLMClient)}
    proxied = {url: client for url, client in clients.items() if isinstance(client, ProxiedReplica)}
    generated = dict(zip(direct, await asyncio.gather(*(_generate(c, name) for c in direct.values())), strict=True))
    if proxied:
        routed = sum(replica.proxy_state == "ready" for replica in snapshot.replicas)
        fleet = next(iter(proxied.values())).proxy
        generated.update(await generate_through_proxy(fleet, name, PROBE_PROMPT, list(proxied), routed,
                                                      PROBE_GENERATE_TIMEOUT_S))
    return {url: generated[url] for url in clients}


async def _probe_adapter(settings: StackSettings, snapshot: Snapshot, report: ProbeReport,
                         clients: dict[str, Replica], proxy: VLLMClient | None) -> None:
    root = settings.adapter_root
    if not root.is_dir():
        report.skipped = f"ADAPTER_ROOT {root} is not a directory here: the probe adapter cannot be published"
        return
    served = [r.info.model for r in snapshot.reachable() if r.info is not None]
    base = snapshot.proxy_base_model or (served[0] if served else settings.base_model)
    try:
        config = base_model_config(list(dict.fromkeys([base, settings.base_model])))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        report.skipped = f"cannot build the probe adapter: {exc}"
        return
    try:
        report.name, directory = publish_probe_adapter(settings, config, base)
    except (OSError, KeyError, ValueError) as exc:
        report.skipped = f"cannot write the probe adapter under {root} here: {exc}"
        return
    report.path = str(directory.resolve())
    report.served = norm_path(str(settings.content_store / fingerprint(directory).removeprefix(FINGERPRINT_PREFIX)))
    log_event(log, "probe_published", name=report.name, path=report.path)
    try:
        await _probe_load_and_generate(snapshot, report, clients, proxy)
    finally:
        still = [] if report.skipped else await _probe_unload(report, clients, proxy)  # skipped: never loaded
        if still:
            # Deleting files of a registered adapter kills vLLM's engine when it re-reads them: keep them.
            log_event(log, "probe_kept", logging.WARNING, path=report.path, replicas=",".join(still))
        else:
            shutil.rmtree(directory, ignore_errors=True)
            report.deleted = not directory.exists()


async def _probe_load_and_generate(snapshot: Snapshot, report: ProbeReport, clients: dict[str, Replica],
                                   proxy: VLLMClient | None) -> None:
    try:
        if proxy is not None:
            await proxy.load_lora_adapter(report.name, report.path)
        else:
            results = await asyncio.gather(*(c.load_lora_adapter(report.name, report.path) for c in clients.values()),
                                           return_exceptions=True)
            report.direct_load_error = {url: str(r) if isinstance(r, BaseException) else None
                                        for url, r in zip(clients, results, strict=True)}
            if any(report.direct_load_error.values()):
                report.load_error = "direct load failed on some replicas"
    except VLLMError as exc:
        if exc.status == 409 and exc.error_type == BUDGET_ERROR:
            # Several runs share the fleet and their reservations fill every LoRA slot: the probe has none to take
            # (their own publishes prove the store through the same path). Not a fault of the fleet: said, not failed.
            report.skipped = (f"probe not run: the proxy has no LoRA slot for it ({exc.message}); run the doctor "
                              "with --probe (make doctor PROBE=1) once a run has finished or expired")
            log_event(log, "probe_no_slot", logging.WARNING, name=report.name, error=exc)
            return
        report.load_error = str(exc)
        log_event(log, "probe_load_failed", logging.WARNING, name=report.name, error=exc)
        # Which replica cannot read it? Ask each one directly (unloaded again in _probe_unload).
        results = await asyncio.gather(*(c.load_lora_adapter(report.name, report.path) for c in clients.values()),
                                       return_exceptions=True)
        report.direct_load_error = {url: (None if not isinstance(r, BaseException) or
                                          (isinstance(r, VLLMError) and r.already_loaded) else str(r))
                                    for url, r in zip(clients, results, strict=True)}
    listed = await asyncio.gather(*(_listed(c, report.name, report) for c in clients.values()))
    report.listed_after_load = {url: state is True for url, state in zip(clients, listed, strict=True)}
    report.generate_error = await _generate_all(snapshot, clients, report.name)
    log_event(log, "probe_generated", name=report.name,
              failed=",".join(url for url, error in report.generate_error.items() if error) or "none")


async def _probe_unload(report: ProbeReport, clients: dict[str, Replica], proxy: VLLMClient | None) -> list[str]:
    """Unload the probe (through the proxy), observe each replica, then unload directly what is left.

    Returns the replicas that still hold the probe (its files must then stay)."""
    if proxy is not None:
        try:
            await proxy.unload_lora_adapter(report.name)
        except VLLMError as exc:
            if not (exc.status == 404 and report.load_error):  # 404 after a failed load: nothing was loaded
                report.unload_error = str(exc)
        listed = await asyncio.gather(*(_listed(c, report.name, report) for c in clients.values()))
        report.listed_after_unload = {url: state is not True for url, state in zip(clients, listed, strict=True)}
    still = []
    for url, client in clients.items():
        try:
            await client.unload_lora_adapter(report.name)
        except VLLMError as exc:
            if exc.status != 404:
                still.append(url)
    return still


async def _probe_pause(report: ProbeReport, clients: dict[str, Replica], proxy: VLLMClient) -> None:
    """Pause and resume through the proxy twice, observing every replica, and the proxy's own pause state, after each
    step.

    First in `wait` mode (in-flight requests finish, none is lost), which the proxy always broadcasts;
    then in `keep` mode, the trainer's own sync pause, which under PROXY_SYNC_PAUSE=elide pauses no
    replica. Another client (a trainer's sync, a second doctor) may pause or resume the fleet meanwhile: the
    replicas are judged against the proxy's state, and no replica the proxy holds paused is resumed behind its back.
    A replica left paused while the proxy's fleet is not is resumed directly.
    """
    try:
        report.pause_error, report.paused = await _pause(report, "pause", proxy, clients, "wait")
        report.resume_error, report.paused_after_resume = await _resume(report, "resume", proxy, clients)
        report.keep_error, report.keep_paused = await _pause(report, "keep", proxy, clients, "keep")
        keep_resume_error, _ = await _resume(report, None, proxy, clients)  # looked at, not judged
        report.keep_error = report.keep_error or keep_resume_error
    finally:
        if await _fleet_pause(proxy) in (None, UNREAD):  # the fleet runs (or may): no replica may stay paused
            after = await asyncio.gather(*(_paused(c) for c in clients.values()))
            for url, state in zip(clients, after, strict=True):
                if state is not False:  # never leave a replica paused behind the doctor
                    with contextlib.suppress(VLLMError):
                        await clients[url].resume()
                    log_event(log, "probe_resumed_directly", logging.WARNING, replica=url)


async def _fleet_pause(proxy: VLLMClient) -> str | object | None:
    """The proxy's own pause state (GET /fleet "paused": the mode of the pause in effect, or None); UNREAD when the
    proxy does not say."""
    return (await _fleet_look(proxy))[0]


async def _fleet_look(proxy: VLLMClient) -> tuple[str | object | None, int | None]:
    """The proxy's pause state (as `_fleet_pause`) and its broadcast epoch (GET /fleet "broadcast_epoch": odd while a
    fleet-wide change is on its way to the replicas; None from a proxy that does not say)."""
    try:
        view = (await proxy.request("GET", "/fleet")).json()
        return view.get("paused", UNREAD), view.get("broadcast_epoch")
    except (VLLMError, ValueError, AttributeError):
        return UNREAD, None


async def _observe(report: ProbeReport, step: str | None, proxy: VLLMClient,
                   clients: dict[str, Replica]) -> dict[str, bool | str]:
    """Each replica's is_paused after `step`, read between two reads of the proxy's pause state, which goes into
    report.fleet_paused[step] (a step that is not judged, None, records nothing).

    A look is steady when both reads agree and no broadcast ran meanwhile (the same even broadcast epoch): the
    proxy records a pause or resume only after the replicas took it, so a look taken while another client's
    broadcast is on its way would see replicas ahead of the proxy's state. Up to OBSERVE_TRIES looks: another look
    when it was not steady or when a replica differs from the proxy's state; a replica that still differs after
    the last steady look is what the check judges, and a state that changed at every look is CHANGING."""
    seen: dict[str, bool | str] = {}
    steady: object = CHANGING
    for look in range(OBSERVE_TRIES):
        if look:
            await asyncio.sleep(OBSERVE_PAUSE_S)
        before = await _fleet_look(proxy)
        states = dict(zip(clients, await asyncio.gather(*(_paused(c) for c in clients.values())), strict=True))
        after = await _fleet_look(proxy)
        epoch = after[1]
        if before != after or (isinstance(epoch, int) and epoch % 2):
            seen = seen if steady is not CHANGING else states
            continue
        steady, seen = after[0], states
        if steady is UNREAD or all(state is (steady is not None) for state in states.values()):
            break
    if step is not None and steady is not UNREAD:
        report.fleet_paused[step] = steady  # type: ignore[assignment]
    return seen


async def _pause(report: ProbeReport, step: str | None, proxy: VLLMClient, clients: dict[str, Replica],
                 mode: PauseMode) -> tuple[str | None, dict[str, bool | str]]:
    """POST /pause?mode=`mode` through the proxy; the error (or None) and each replica's is_paused after it."""
    error = None
    try:
        await proxy.pause(mode)
    except VLLMError as exc:
        error = str(exc)
    return error, await _observe(report, step, proxy, clients)


async def _resume(report: ProbeReport, step: str | None, proxy: VLLMClient,
                  clients: dict[str, Replica]) -> tuple[str | None, dict[str, bool | str]]:
    """POST /resume through the proxy; the error (or None) and each replica's is_paused after it."""
    error = None
    try:
        await proxy.resume()
    except VLLMError as exc:
        error = str(exc)
    return error, await _observe(report, step, proxy, clients)
