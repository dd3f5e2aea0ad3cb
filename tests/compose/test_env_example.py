""".env.example documents every variable compose.yaml and the settings schema read, with real defaults."""

from __future__ import annotations

from typing import Any

from lorafleet.settings import StackSettings, env_name, load_settings
from lorafleet_ops.docsite.reference import env_default
from lorafleet_testing.compose_helpers import (
    COMPOSE_FILE,
    COMPOSE_VAR,
    ENV_EXAMPLE,
    EnvEntry,
    parse_env_example,
    required_compose_vars,
)

# Compose's own variables (read from .env by the CLI), allowed in .env.example without appearing in compose.yaml.
COMPOSE_CLI_VARS = {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME", "COMPOSE_FILE"}


def compose_vars() -> dict[str, set[str]]:
    """Every variable compose.yaml interpolates -> the defaults it gives it (`${NAME:-default}`)."""
    found: dict[str, set[str]] = {}
    for match in COMPOSE_VAR.finditer(COMPOSE_FILE.read_text()):
        defaults = found.setdefault(match["name"], set())
        if (match["op"] or "").endswith("-"):
            defaults.add(match["arg"])
    return found


def cpu_profile_defaults() -> dict[str, str]:
    """The cpu profile's own defaults: compose.yaml's `x-cpu-env` block (`NAME: ${NAME:-default}`)."""
    block = COMPOSE_FILE.read_text().split("x-cpu-env: &cpu-env\n", 1)[1].split("\n\n", 1)[0]
    return {match["name"]: match["arg"] for match in COMPOSE_VAR.finditer(block) if (match["op"] or "") == ":-"}


def test_cpu_profile_defaults_are_stated_next_to_the_profile() -> None:
    """.env.example's comment above COMPOSE_PROFILES names each cpu-profile default with its value."""
    text = ENV_EXAMPLE.read_text()
    comment = text[: text.index("\nCOMPOSE_PROFILES=")].rsplit("\n\n", 1)[-1]
    defaults = cpu_profile_defaults()
    assert set(defaults) == {"BASE_MODEL", "MODEL_CACHE", "MAX_MODEL_LEN", "VLLM_DTYPE", "TRAINER_TASK"}, defaults
    assert "tiny model" in comment and "BASE_MODEL" in comment and "MODEL_CACHE" in comment, comment
    for name, value in defaults.items():
        if name not in ("BASE_MODEL", "MODEL_CACHE"):  # paths in the store, named in words
            assert f"{name} {value}" in comment, f"{name} {value} not stated above COMPOSE_PROFILES"


def schema_vars() -> set[str]:
    return {env_name(name) for name in StackSettings.model_fields}


def test_every_compose_variable_is_documented(env_entries: dict[str, EnvEntry]) -> None:
    missing = sorted(set(compose_vars()) - set(env_entries))
    assert not missing, f".env.example does not document {missing} (used in compose.yaml)"


def test_every_setting_is_documented(env_entries: dict[str, EnvEntry]) -> None:
    missing = sorted(schema_vars() - set(env_entries))
    assert not missing, f".env.example does not document {missing} (fields of lorafleet.settings.StackSettings)"


def test_nothing_stale_is_documented(env_entries: dict[str, EnvEntry]) -> None:
    stale = sorted(set(env_entries) - schema_vars() - set(compose_vars()) - COMPOSE_CLI_VARS)
    assert not stale, f".env.example documents {stale}, which neither compose.yaml nor the schema reads"


def test_every_variable_has_a_one_line_explanation(env_entries: dict[str, EnvEntry]) -> None:
    unexplained = sorted(name for name, entry in env_entries.items() if len(entry.explanation) < 10)
    assert not unexplained, f"no explanation comment right above {unexplained}"


def test_documented_defaults_are_the_real_defaults(env_entries: dict[str, EnvEntry]) -> None:
    """A commented `# NAME=value` claims to be the default: it must equal the schema's or compose.yaml's."""
    fields = {env_name(name): field for name, field in StackSettings.model_fields.items()}
    wrong = []
    for name, entry in env_entries.items():
        if name in fields and entry.commented and entry.value != env_default(fields[name]):
            wrong.append(f"{name}: documented {entry.value!r}, schema default {env_default(fields[name])!r}")
    cpu_defaults = cpu_profile_defaults()
    for name, defaults in compose_vars().items():
        entry = env_entries.get(name)
        defaults = defaults - {cpu_defaults.get(name)}  # stated with the profile (see the test below)
        if entry and defaults and defaults != {entry.value}:
            wrong.append(f"{name}: compose.yaml defaults {sorted(defaults)}, .env.example says {entry.value!r}")
    assert not wrong, "\n".join(wrong)


def test_required_secrets_are_marked_and_shipped_empty(env_entries: dict[str, EnvEntry]) -> None:
    marked = {name for name, entry in env_entries.items() if "REQUIRED" in entry.explanation}
    assert marked == required_compose_vars()
    for name in marked:
        assert not env_entries[name].commented and env_entries[name].value == "", f"{name} must be set, and empty"


def test_env_example_values_are_valid_settings(env_entries: dict[str, EnvEntry], monkeypatch: Any) -> None:
    """What a newcomer gets after `cp .env.example .env` (plus the secret) passes the schema's validation."""
    for name in schema_vars():
        monkeypatch.delenv(name, raising=False)
    values = {name: entry.value for name, entry in env_entries.items() if not entry.commented}
    values.update(dict.fromkeys(required_compose_vars(), "a-secret-key"))
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")  # only the values set above, no .env from the working directory
    settings = load_settings()
    gpus = settings.gpu_pool
    trainer_gpus = values["TRAINER_GPUS"].split(",")
    # The GPU layout rule: trainer GPUs + one GPU per replica, disjoint.
    assert not set(gpus) & set(trainer_gpus), f"TRAINER_GPUS {trainer_gpus} overlaps VLLM_GPUS {gpus}"
    assert int(values["REPLICAS"]) <= len(gpus), "more replicas than GPUs in VLLM_GPUS"
    assert int(values["REPLICAS"]) <= len(settings.cpu_pool), "more replicas than core sets in VLLM_CPU_SETS"


def test_parser_reads_entries_and_explanations() -> None:
    """The checks above rest on this parser; it must see set, commented and explained entries."""
    entries = parse_env_example("# Explains A.\nA=1\n\n# Explains B.\n# B=two\nC=\n")
    assert entries["A"] == EnvEntry("A", "1", False, "Explains A.")
    assert entries["B"] == EnvEntry("B", "two", True, "Explains B.")
    assert entries["C"].explanation == ""
    assert ENV_EXAMPLE.read_text().endswith("\n")
