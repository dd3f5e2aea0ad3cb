"""The doctor's checks of the probe (checks 4 and 5): what publishing, loading, generating with and pausing around one
probe adapter showed on every replica. Pure functions of a ProbeReport and a Snapshot, as in `fleet_checks`."""

from __future__ import annotations

from lorafleet.settings import StackSettings

from lorafleet_ops.commands.doctor.model import CHANGING, CheckResult, ProbeReport, Snapshot, Status, not_checked


def check_probe(report: ProbeReport, snapshot: Snapshot, settings: StackSettings) -> CheckResult:
    """4. Every replica reads the adapter root at the same path: the probe was loaded and generated everywhere."""
    name = "adapter_root"
    if report.skipped:
        return CheckResult(name, Status.SKIP, report.skipped, _skip_fix(report.skipped))
    root = settings.adapter_root
    refused = {url: error for url, error in report.direct_load_error.items() if error}
    blind = {url: error for url, error in refused.items() if "No adapter found" in error}
    failed_gen = {url: error for url, error in report.generate_error.items() if error and url not in refused}
    not_listed = [url for url, ok in report.listed_after_load.items() if not ok]
    problems = [f"{url} cannot read {report.path}: {error}" if url in blind else
                f"{url} refused the probe adapter: {error}" for url, error in refused.items()]
    if not refused and report.load_error:
        problems.append(f"loading the probe {report.name} from {report.path} failed: {report.load_error}")
    problems += [f"{url} did not generate with the probe: {error}" for url, error in failed_gen.items()]
    if not problems and not_listed:
        problems.append(f"the probe is not in /v1/models of {', '.join(not_listed)} after the load")
    if blind:
        fix = (f"mount the adapter volume at ADAPTER_ROOT={root} (the same absolute path) in every replica, "
               f"readable by its user: {', '.join(blind)} cannot see it")
    else:
        fix = "see lora_enabled and the replica's log for the refused load or generation"
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems), fix)
    where = "through the proxy" if report.broadcast else "directly"
    seen = f"probe adapter under {root} loaded {where} and generated with on all {len(report.generate_error)} " \
           f"replica(s)"
    if not report.deleted:
        return CheckResult(name, Status.WARN, f"{seen}, but its files stay at {report.path}: a replica still holds "
                           f"{report.name} (see broadcasts)", f"unload {report.name} there, then delete the directory")
    return CheckResult(name, Status.PASS, f"{seen}, then unloaded and deleted.{not_checked(snapshot)}".rstrip("."))


def _skip_fix(reason: str) -> str:
    if " here" in reason:
        return ("run the doctor where the trainer runs, with ADAPTER_ROOT mounted read-write "
                "(e.g. `docker compose run --rm trainer lorafleet doctor`)")
    return ""


def check_broadcasts(report: ProbeReport, snapshot: Snapshot) -> CheckResult:
    """8. Load, unload, pause and resume through the proxy reached every replica (seen on each replica).

    The pause is sent in `wait` mode, which the proxy always broadcasts. The trainer's own `keep`
    pause is sent too: under PROXY_SYNC_PAUSE=elide the proxy answers it without pausing any replica
    (by design, so generation never stalls on a sync); that is reported, not failed.
    """
    name = "broadcasts"
    if not report.broadcast:
        return CheckResult(name, Status.SKIP, report.skipped or "no proxy to broadcast through", "see fleet")
    if not report.paused:
        return CheckResult(name, Status.SKIP, report.skipped or "no replica observed: nothing was broadcast",
                           _skip_fix(report.skipped) or "see fleet and lora_enabled")
    problems = []
    if report.path:
        if report.load_error is None:
            problems += [f"load did not reach {url}" for url, ok in report.listed_after_load.items() if not ok]
        if report.unload_error:
            problems.append(f"unload through the proxy failed: {report.unload_error}")
        problems += [f"unload did not reach {url}" for url, ok in report.listed_after_unload.items() if not ok]
    unjudged = []
    for step, own, error, is_paused in (("pause", True, report.pause_error, report.paused),
                                         ("resume", False, report.resume_error, report.paused_after_resume)):
        if error:
            problems.append(f"{step} through the proxy failed: {error}")
        step_problems = _step_problems(report, step, own, is_paused)
        if step_problems is None:
            unjudged.append(step)
        else:
            problems += step_problems
    keep, keep_problem = _keep_pause(report, snapshot)
    if keep_problem:
        problems.append(keep_problem)
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "the proxy must broadcast to every replica: check its log for that replica (state, "
                           "last_error in GET /fleet); a replica it does not know gets no broadcasts")
    count = len(report.paused)
    if unjudged:
        return CheckResult(name, Status.WARN, f"{' and '.join(unjudged)} not judged: other clients paused or "
                           f"resumed the fleet while the doctor looked (a trainer's sync, another doctor); {keep}",
                           "run the doctor again when no trainer is starting or syncing")
    if not report.path or report.load_error is not None or report.skipped:
        why = report.skipped or "the probe load failed"
        return CheckResult(name, Status.WARN, f"pause, resume reached all {count} replica(s); {keep}; load and "
                           f"unload were not observed: {why}", "see adapter_root")
    return CheckResult(name, Status.PASS, f"load, unload, pause, resume through the proxy observed on all "
                       f"{count} replica(s); {keep}")


def _step_problems(report: ProbeReport, step: str, own: bool, is_paused: dict[str, bool | str]) -> list[str] | None:
    """The replicas whose is_paused after the doctor's `step` (which pauses the fleet: `own`) is not what
    `_expected_paused` says; None when not judged."""
    expected = _expected_paused(report, step, own)
    if expected is None:
        return None
    other = "resumed" if own else "paused"
    return [f"{step} did not reach {url} (is_paused: {state})" if expected is own else
            f"{url} has is_paused: {state} though another client {other} the fleet"
            for url, state in is_paused.items() if state is not expected]


def _expected_paused(report: ProbeReport, step: str, own: bool) -> bool | None:
    """Whether every replica should be paused after `step`: as the proxy's fleet was when the doctor looked (another
    client may have paused or resumed it since the step), else as the step itself left it (`own`); None when other
    clients changed it throughout the look (not judged)."""
    if step not in report.fleet_paused:
        return own
    state = report.fleet_paused[step]
    return None if state == CHANGING else state is not None


def _keep_pause(report: ProbeReport, snapshot: Snapshot) -> tuple[str, str]:
    """What the trainer's `keep` pause did, and a problem when that contradicts the proxy's PROXY_SYNC_PAUSE."""
    if report.keep_error:
        return "", f"the trainer's keep pause through the proxy failed: {report.keep_error}"
    if not report.keep_paused:
        return "", "the trainer's keep pause was not observed on any replica"
    paused = [url for url, state in report.keep_paused.items() if state is True]
    mode = snapshot.sync_pause
    state = report.fleet_paused.get("keep", "keep")
    if state == CHANGING or state not in ("keep", None) or (state is None and mode == "broadcast"):
        # Another client's pause held the fleet, or another client resumed it, while the doctor looked.
        return "the trainer's keep pause not judged: another client paused or resumed the fleet meanwhile", ""
    if not paused:
        if mode == "broadcast":
            return "", "keep pause did not reach any replica although the proxy reports PROXY_SYNC_PAUSE=broadcast"
        return (f"the trainer's keep pause is elided (PROXY_SYNC_PAUSE={mode or 'not reported'}): replicas keep "
                "generating during weight syncs"), ""
    if len(paused) < len(report.keep_paused):
        missed = [url for url in report.keep_paused if url not in paused]
        return "", f"keep pause reached {', '.join(paused)} but not {', '.join(missed)}"
    if mode == "elide":
        return "", "the proxy reports PROXY_SYNC_PAUSE=elide but the trainer's keep pause paused every replica"
    return f"the trainer's keep pause is broadcast (PROXY_SYNC_PAUSE={mode or 'not reported'})", ""
