"""Run identity on a shared fleet: run names, the per-run URL prefix, and fleet-unique adapter names.

Several trainers share one proxy and its replicas; each is a *run*. A trainer reaches the proxy as run
`<run>` through the URL prefix `/runs/<run>` (TRAINER_VLLM_URL=http://proxy:8000/runs/b), which TRL's
client keeps in front of every route it calls. A trainer without the prefix is the default run, the
single-run fleet as it always was. Run `b`'s adapter `trl-policy-v3` is `b--trl-policy-v3` on the
replicas (`qualify`); the default run's names are not qualified.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

DEFAULT_RUN = "default"  # a trainer without a run identity; its adapter names are not qualified
RUN_NAME_DEFAULT = "run1"  # RUN_NAME's default: the folder of the default run's trainer, so never a keyed run's name
RUN_SEPARATOR = "--"
RUN_URL_PREFIX = "/runs/"
BUDGET_ERROR = "SlotBudgetExceeded"  # the error type of the proxy's 409 for a run that does not fit the slot budget
# A run's name: letters and digits in groups joined by one '.', '_' or '-' (never "--", the separator), at most
# 32 characters, so `<run>--<name>` splits at its first "--" and fits vLLM's adapter names.
RUN_PATTERN = re.compile(r"^(?=.{1,32}$)[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*$")


def run_slots(max_staleness: int) -> int:
    """LoRA slots one run reserves on every replica: max_staleness + 1 versions can be in flight, and a sync loads
    the next before it unloads the oldest. The one place this arithmetic lives (settings, ledger, proxy, doctor)."""
    return max_staleness + 2


def slot_budget(max_runs: int, max_staleness: int) -> int:
    """--max-loras for a fleet shared by `max_runs` runs of this staleness."""
    return max_runs * run_slots(max_staleness)


class RunNameError(ValueError):
    """A run name does not match RUN_PATTERN."""


def check_run_name(run: object) -> str:
    if not isinstance(run, str) or not RUN_PATTERN.fullmatch(run):
        raise RunNameError(f"invalid run name {run!r}: 1-32 letters and digits in groups joined by one '.', '_' or "
                           f"'-' (never {RUN_SEPARATOR!r})")
    return run


def qualify(run: str, name: str) -> str:
    """The fleet-unique name of run `run`'s adapter `name` (the name replicas know it by)."""
    return name if run == DEFAULT_RUN else f"{run}{RUN_SEPARATOR}{name}"


def run_of(qualified: str) -> tuple[str, str]:
    """(run, the run's own name) of a fleet-unique adapter name; names without the separator are the default run's."""
    run, separator, name = qualified.partition(RUN_SEPARATOR)
    if not separator or run == DEFAULT_RUN or not RUN_PATTERN.fullmatch(run) or not name:
        return DEFAULT_RUN, qualified
    return run, name


def fleet_url(url: str) -> str:
    """The proxy's own base URL behind a run's URL (`http://proxy:8000/runs/b` -> `http://proxy:8000`)."""
    base = url.rstrip("/")
    if url_run(base) == DEFAULT_RUN:
        return base
    return base[: base.rindex(RUN_URL_PREFIX)]


def run_url(fleet: str, run: str) -> str:
    """The URL a run's trainer uses: `<fleet>/runs/<run>` (the inverse of fleet_url and url_run)."""
    return f"{fleet.rstrip('/')}{RUN_URL_PREFIX}{check_run_name(run)}"


def url_run(url: str) -> str:
    """The run a base URL speaks for: `<run>` of `http://proxy:8000/runs/<run>`, else the default run."""
    path = urlsplit(url).path.rstrip("/")
    if not path.startswith(RUN_URL_PREFIX):
        return DEFAULT_RUN
    return check_run_name(path[len(RUN_URL_PREFIX):])
