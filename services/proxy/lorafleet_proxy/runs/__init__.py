"""Several training runs on one fleet: run identity, adapter namespaces, the slot budget, run pauses, leases,
fair share, run keys. `Runs` (registry.py) is the one object that decides about runs; names.py maps names in and
out, budget.py holds the slot arithmetic, fairshare.py the queue between runs, key_check.py the check of run keys,
confinement.py the folders a run may load from.

A request under `/runs/<run>/` belongs to that run (the front strips the prefix); one without it to the default run,
which is exactly the single-run fleet. The model, its rules and the reasons for them: docs/concepts/runs.md.
"""

from .budget import SlotBook, SlotBudget
from .fairshare import FairShare, Ticket
from .key_check import RunKeyRefused, RunKeys
from .names import RUN_SCOPE_KEY, NameMap, foreign_name, not_its_own, own_name, split_run_path
from .registry import LiveRun, Runs, Turn

__all__ = ["RUN_SCOPE_KEY", "FairShare", "LiveRun", "NameMap", "RunKeyRefused", "RunKeys", "Runs", "SlotBook",
           "SlotBudget", "Ticket", "Turn", "foreign_name", "not_its_own", "own_name", "split_run_path"]
