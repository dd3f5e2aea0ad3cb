"""`lorafleet status`: the proxy's /fleet and the run's latest metrics as a table an operator can read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from lorafleet.adapters import policy_version
from lorafleet.ratio_outliers import METRICS_KEY, outliers, pooled, read_rows
from lorafleet.runs import DEFAULT_RUN, RUN_SEPARATOR, run_of
from lorafleet.settings import StackSettings


def fleet_endpoint(settings: StackSettings) -> tuple[str, str]:
    """URL and bearer key of the proxy as seen from where the CLI runs.

    With PROXY_API_KEY set (the Compose stack) that is the public port on 127.0.0.1; otherwise
    the fleet port the trainer uses (CPU mode, inside the stack).
    """
    if settings.proxy_api_key:
        return f"http://127.0.0.1:{settings.proxy_public_port}", settings.proxy_api_key
    return settings.trainer_vllm_url, ""


def fetch_fleet(url: str, token: str = "", timeout: float = 10.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url.rstrip("/") + "/fleet", headers=headers, timeout=timeout)
    response.raise_for_status()
    return response.json()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of a run's metrics.jsonl (a missing file is an empty run); partial lines are skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # the trainer may be writing this line right now
    return rows


def latest(rows: list[dict[str, Any]], key: str) -> Any:
    """The newest logged value of `key` (TRL logs different keys on different steps)."""
    for row in reversed(rows):
        if key in row:
            return row[key]
    return None


def adapter_span(names: list[str]) -> str:
    """`trl-policy-v5 … v9 (5)` for a run of policy versions, per run on a shared fleet
    (`a--trl-policy-v3 … v7, b--trl-policy-v5 … v9 (10)`); other names are listed."""
    if not names:
        return "-"
    by_run: dict[str, list[str]] = {}
    for name in names:
        run, own = run_of(name)
        by_run.setdefault(run, []).append(own)
    parts = []
    for run in sorted(by_run, key=lambda r: (r != DEFAULT_RUN, r)):
        prefix = "" if run == DEFAULT_RUN else f"{run}{RUN_SEPARATOR}"
        versions = sorted(v for v in map(policy_version, by_run[run]) if v is not None)
        if versions:
            parts.append(f"{prefix}trl-policy-v{versions[0]}" + (f" … v{versions[-1]}" if len(versions) > 1 else ""))
        parts += sorted(prefix + n for n in by_run[run] if policy_version(n) is None)
    return ", ".join(parts) + f" ({len(names)})"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def fmt(value: Any, spec: str) -> str:
    """`value` formatted with `spec`, or `-` when nothing was logged."""
    return "-" if value is None else format(value, spec)


def render_runs(fleet: dict[str, Any]) -> list[str]:
    """The runs sharing the fleet (none on a single-run fleet): slots, adapters, tokens, share, pause, lease."""
    runs = fleet.get("runs", [])
    if not any(row.get("run") != "default" for row in runs):
        return []
    slots = fleet.get("slots", {})
    lines = ["", f"runs: slot budget {slots.get('capacity', '?')} (--max-loras), "
             f"reserved {slots.get('reserved', '?')}, unreclaimed {len(slots.get('unreclaimed', []))}",
             f"{'RUN':<16} {'SLOTS':>5} {'WEIGHT':>6} {'INFLIGHT':>8} {'TOKENS':>10} {'SHARE':>6}  {'PAUSED':<6} "
             f"{'LEASE':>6}  ADAPTERS"]
    for row in runs:
        lease = row.get("lease_left_s")
        lines.append(
            f"{row.get('run', '?'):<16} {row.get('slots', 0):>5} {row.get('weight', 1.0):>6g} "
            f"{row.get('inflight', 0):>8} {row.get('generated_tokens', 0):>10} "
            f"{_pct(round(1000 * row.get('share', 0)), 1000):>6}  "
            f"{row.get('paused') or '-':<6} {'-' if lease is None else f'{lease:.0f}s':>6}  "
            f"{adapter_span(row.get('adapters', []))}")
    return lines


def render_ratio_by_replica(metrics: list[dict[str, Any]]) -> list[str]:
    """The latest window's importance ratio per (replica, version), the fleet's beside it, outliers marked."""
    step = next((row for row in reversed(metrics) if row.get(METRICS_KEY)), None)
    if step is None:
        return []
    rows = read_rows(step[METRICS_KEY])
    odd = {(found.replica, found.version): found for found in outliers(rows)}
    tokens, mean, std = pooled(rows)
    lines = [f"ratio by replica (step {step.get('step', '?')}; fleet ratio {fmt(step.get('ratio'), '.4f')}, "
             f"log-ratio {mean:+.5f} ± {std:.5f} over {tokens} tokens):",
             f"  {'REPLICA':<32} {'VERSION':>7} {'TOKENS':>7} {'LOG-RATIO':>10} {'|LOG-RATIO|':>11} {'SPREAD':>8} "
             f"{'RATIO':>7}"]
    for row in rows:
        flag = odd.get((row.replica, row.version))
        lines.append(f"  {row.replica:<32} {'v' + str(row.version):>7} {row.tokens:>7} {row.log_ratio_mean:>+10.5f} "
                     f"{row.abs_log_ratio_mean:>11.5f} {row.log_ratio_std:>8.5f} {row.ratio_mean:>7.4f}"
                     + (f"  OUTLIER (+{flag.departure:.4f} nats over its peers, evidence {flag.score:.1f} > "
                        f"{flag.bound:g})" if flag else ""))
    return lines


def render_status(fleet: dict[str, Any], url: str, metrics: list[dict[str, Any]] | None = None) -> str:
    replicas = fleet.get("replicas", [])
    ready = sum(1 for r in replicas if r.get("state") == "ready")
    router = fleet.get("router", {})
    lines = [
        f"fleet {url}  ready {ready}/{len(replicas)} (min {fleet.get('min_ready', '?')})  "
        f"routing {router.get('mode', '?')}  block {router.get('block_size', '?')} tokens",
        "",
        f"{'REPLICA':<32} {'STATE':<8} {'INFLIGHT':>8} {'ROUTED':>8}  ADAPTERS",
    ]
    for replica in replicas:
        lines.append(
            f"{replica.get('url', '?'):<32} {replica.get('state', '?'):<8} {replica.get('inflight', 0):>8} "
            f"{replica.get('routed', 0):>8}  {adapter_span(list(replica.get('adapters', {})))}"
        )
        if replica.get("last_error"):
            lines.append(f"{'':<32} last error: {replica['last_error']}")
        attestation = replica.get("attestation") or {}
        if attestation.get("state") in ("unattested", "disagrees"):
            lines.append(f"{'':<32} {attestation['state']}: {attestation.get('failure')}")
        elif attestation.get("state") == "attested":
            lines.append(f"{'':<32} attested {attestation.get('adapters', 0)} adapter(s) "
                         f"{attestation.get('age_s')}s ago")
    ledger = fleet.get("ledger", [])
    lines += ["", f"ledger: {adapter_span([entry['name'] for entry in ledger])}"]
    lines += render_runs(fleet)
    routed = int(router.get("routed", 0))
    lines.append(
        f"router: routed {routed}  affinity {_pct(router.get('affinity', 0), routed)}  "
        f"spilled {_pct(router.get('spilled', 0), routed)}  unmatched {_pct(router.get('unmatched', 0), routed)}  "
        f"tracked blocks {router.get('tracked_blocks', 0)}"
    )
    if metrics:
        lines.append(
            f"training: step {fmt(latest(metrics, 'step'), 'd')}  reward {fmt(latest(metrics, 'reward'), '.3f')}  "
            f"ratio {fmt(latest(metrics, 'ratio'), '.4f')}  "
            f"staleness {fmt(latest(metrics, 'sample/staleness_mean'), '.2f')}  "
            f"queue {fmt(latest(metrics, 'sample/rollout_queue_size'), '.0f')}  "
            f"sync {fmt(latest(metrics, 'perf/weight_sync_s'), '.2f')}s"
        )
        lines += render_ratio_by_replica(metrics)
    else:
        lines.append("training: no metrics logged yet")
    return "\n".join(lines)
