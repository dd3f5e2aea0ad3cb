"""Several training runs on one fleet: run identity, adapter namespaces, the slot budget, run pauses, leases,
fair share. `Runs` (registry.py) is the one object that decides about runs; names.py maps names in and out,
budget.py holds the slot arithmetic, fairshare.py the queue between runs.

Identity. A trainer reaches the proxy under `/runs/<run>/` (TRAINER_VLLM_URL=http://proxy:8000/runs/b):
TRL joins its base URL and the route (`/v1/completions`, `/pause`, ...), so an unmodified client works
under the prefix. The front strips it and marks the request with its run. A request without it belongs
to the default run, which is exactly the single-run fleet: its names are not qualified, its pauses are
the fleet's (broadcast or elided), it never expires.

Namespaces. Run `b`'s adapter `trl-policy-v3` is `b--trl-policy-v3` on the replicas and in the ledger
(`lorafleet.runs.qualify`); the proxy maps names in (load, unload, generation `model`) and back in
every answer (bodies, errors, /v1/models), so runs can hold the same TRL names at once. A run sees and
touches only its own names; on the fleet port the default run cannot name another run's adapter either.
The public port (operators, evaluation) may generate with any run's adapter by its qualified name.

Slot budget (budget.py). Every replica's `--max-loras` is shared: a run reserves `max_staleness + 2` slots and
is admitted only while every run's reservation fits; one that does not is refused (409), never queued.

Run pauses. A named run's pause (any mode) holds that run's new generation requests at the proxy and
never pauses a replica; `wait` also answers only once the run's requests in flight are done. `abort`
cannot abort one run's requests on a shared engine (vLLM's /abort_requests is refused by the proxy), so
it holds new requests like `keep`. The pause is in the ledger and survives a proxy restart.

Keys (keys.py). With RUN_KEYS_DIR, a named run's routes on the fleet port need that run's Bearer key (401
without, 403 with another run's), checked before anything changes; the default run and the public port as before.

Leases. A named run that sends nothing for RUN_LEASE_S is expired: its adapters leave the ledger in one
durable write and are unloaded from every ready replica (one that fails re-syncs to the ledger without
them: all or nothing), its reservation is returned, the event logged and counted. A trainer that comes
back re-registers and republishes (TRL does on start).
"""

from .budget import SlotBook, SlotBudget
from .fairshare import FairShare, Ticket
from .keys import RunKeyRefused, RunKeys
from .names import RUN_SCOPE_KEY, NameMap, foreign_name, not_its_own, own_name, split_run_path
from .registry import LiveRun, Runs, Turn

__all__ = ["RUN_SCOPE_KEY", "FairShare", "LiveRun", "NameMap", "RunKeyRefused", "RunKeys", "Runs", "SlotBook",
           "SlotBudget", "Ticket", "Turn", "foreign_name", "not_its_own", "own_name", "split_run_path"]
