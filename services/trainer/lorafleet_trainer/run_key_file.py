"""This trainer's run key: read once at start from TRAINER_RUN_KEY_FILE, sent as a Bearer key to the fleet.

With run keys on (the proxy's RUN_KEYS_DIR), a named run's routes (`/runs/<run>/...`) answer only to that run's key.
The key sits in a file (a Compose secret, a Kubernetes Secret volume) and not in an environment variable: the
environment shows in `docker inspect`, `kubectl describe` and /proc/<pid>/environ. A set but missing, unreadable or
empty file is a config error at start (exit 2), before anything talks to the fleet; an unset one means no key.
The key itself is never logged: only that one is used, and from which file.
"""

from __future__ import annotations

from lorafleet.run_key_store import read_key_file
from lorafleet.settings import ConfigError, TrainerSettings, env_name

KEY_FILE_VARIABLE = env_name("trainer_run_key_file")  # TRAINER_RUN_KEY_FILE


def read_run_key(settings: TrainerSettings) -> str:
    """The key in TRAINER_RUN_KEY_FILE, stripped of whitespace; "" when the setting is empty.

    The file is read as the doctor reads it (lorafleet.run_key_store.read_key_file), so the two never disagree on a key.
    """
    try:
        return read_key_file(settings.trainer_run_key_file)
    except UnicodeDecodeError:
        raise ConfigError(f"{KEY_FILE_VARIABLE}: {settings.trainer_run_key_file} is not a text file holding a run "
                          "key (as `lorafleet run-key` writes it)") from None


def bearer(run_key: str) -> dict[str, str]:
    """The header that carries `run_key`; none without a key."""
    return {"Authorization": f"Bearer {run_key}"} if run_key else {}
