"""`lorafleet doctor`: the preflight checklist of the reference deployment, answered live against the fleet.

Every answer is observed, none assumed: the proxy's `/server_info` and `/fleet` give the trainer's
view and the replica list, each replica is then asked DIRECTLY (its own `/server_info`, `/v1/models`,
`/is_paused`) where it can be (else the proxy's last reading of it is used, marked "via the proxy": the
trainer's container has no route to the replicas), and a probe adapter is written under the adapter root,
loaded through the proxy and generated with on every replica. One job per module:

- `model`: the data (Snapshot, ProbeReport, CheckResult);
- `fleet_checks`: the pure checks, snapshot and probe report in, CheckResult out (unit-tested on recorded payloads);
- `gather`: reading the proxy and the replicas (and the proxy's ledger file when the proxy is down);
- `probe_adapter`, `probe`: writing the probe adapter, and publishing, loading, pausing through the fleet;
- `via_proxy`: the probe's reach to a replica only the proxy can reach;
- `render`: the table; `runner`: all of it in order; `preflight`: the trainer's gate (found by entry point).

The probe changes the fleet for a few seconds (one extra adapter, two pauses): the trainer runs it
before training; the CLI skips it on a fleet that is training unless `--probe` is given.
"""

from lorafleet_ops.commands.doctor.model import CheckResult, ProbeReport, Snapshot, Status
from lorafleet_ops.commands.doctor.preflight import trainer_preflight
from lorafleet_ops.commands.doctor.render import render_table
from lorafleet_ops.commands.doctor.runner import failed, run_doctor, run_doctor_sync

__all__ = ["CheckResult", "ProbeReport", "Snapshot", "Status", "failed", "render_table", "run_doctor",
           "run_doctor_sync", "trainer_preflight"]
