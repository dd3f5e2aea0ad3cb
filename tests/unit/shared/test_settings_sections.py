"""Settings per service (#46): every variable documented before the split still sets the same field, in every
section that reads it, and a service validates only its own section and the common one."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from lorafleet.settings import (
    SECTIONS,
    CommonSettings,
    ConfigError,
    ProxySettings,
    ReplicaSettings,
    StackSettings,
    TrainerSettings,
    load_settings,
    section_fields,
)

BEFORE = Path(__file__).with_name("settings_documented_before_sections.txt")
DOCUMENTED = [line.strip() for line in BEFORE.read_text().splitlines() if line.strip() and not line.startswith("#")]
SERVICES = (ProxySettings, ReplicaSettings, TrainerSettings)
# Values that pass the validators of these string settings (every other type gets a value derived from its default).
VALID_TEXT = {"vllm_gpus": "1,2", "trainer_gpus": "3", "proxy_upstreams": "http://replica-a:8000",
              "trainer_vllm_url": "http://proxy:8000/runs/b", "proxy_upstream_dns": "vllm:8000",
              "vllm_cpu_sets": "0;1-2", "run_name": "b", "trainer_task": "jsonl"}


def other_value(name: str) -> tuple[str, object]:
    """A valid value for `name` other than its default: (as the environment writes it, as the field holds it)."""
    field = StackSettings.model_fields[name]
    annotation, default = field.annotation, field.default
    if name in VALID_TEXT:
        return VALID_TEXT[name], VALID_TEXT[name]
    if typing.get_origin(annotation) is typing.Literal:
        choice = next(choice for choice in typing.get_args(annotation) if choice != default)
        return str(choice), choice
    if annotation is bool:
        return str(not default).lower(), not default
    if annotation is int:
        value = default + 1 if not any(getattr(item, "le", None) == default for item in field.metadata) else default - 1
        return str(value), value
    if annotation is float or annotation == float | None:
        value = default / 2 if default else 0.5
        return str(value), value
    if annotation is Path:
        return "/elsewhere", Path("/elsewhere")
    return "some-value", "some-value"


def test_the_old_list_is_read() -> None:
    assert len(DOCUMENTED) > 90 and "PROXY_PORT" in DOCUMENTED and "TRAINER_GPUS" in DOCUMENTED


@pytest.mark.parametrize("variable", DOCUMENTED)
def test_every_variable_documented_before_sets_its_field_in_every_section_that_reads_it(
        variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = variable.lower()
    owners = [key for key, section in SECTIONS if name in section_fields(section)]
    assert len(owners) == 1, f"{variable} belongs to one section, not {owners}"
    raw, value = other_value(name)
    monkeypatch.setenv(variable, raw)
    readers = [section for section in (*SERVICES, StackSettings) if name in section.model_fields]
    assert StackSettings in readers and len(readers) >= 2
    for section in readers:
        assert getattr(load_settings(section), name) == value, (variable, section.__name__)


# One bad value per section: the services that do not read it start; the ones that do stop, naming it.
BAD = {"common": ("LORA_RANK", "0"), "replica": ("VLLM_CPU_SETS", "x;y"), "proxy": ("PROXY_ROUTING", "random"),
       "trainer": ("TRAINER_GPUS", "zero")}


@pytest.mark.parametrize("owner", list(BAD))
def test_a_bad_setting_stops_only_the_services_that_read_it(owner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    variable, raw = BAD[owner]
    monkeypatch.setenv(variable, raw)
    for section in SERVICES:
        if variable.lower() in section.model_fields:
            with pytest.raises(ConfigError, match=rf"^invalid configuration:\n  {variable}: "):
                load_settings(section)
        else:
            assert load_settings(section)  # another section's mistake is not this service's
    with pytest.raises(ConfigError, match=variable):
        load_settings(StackSettings)  # the operations tools see every section


def test_each_service_reads_only_its_section_and_the_common_one() -> None:
    common = set(CommonSettings.model_fields)
    for section in SERVICES:
        own = set(section.model_fields) - common
        others = {name for other in SERVICES if other is not section for name in other.model_fields} - common
        shared = own & others
        assert shared <= {"proxy_upstream_token"}, (section.__name__, shared)  # the replicas' key: both ends
    assert set(StackSettings.model_fields) == {name for section in SERVICES for name in section.model_fields}


def test_the_trainers_preflight_sees_the_other_sections_without_being_stopped_by_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor, run by the trainer before it trains, compares sections (VLLM_GPUS against TRAINER_GPUS): it reads
    the others as the environment gives them, and a section that does not load is not the trainer's to judge."""
    from lorafleet_ops.commands.doctor.preflight import stack_view

    monkeypatch.setenv("VLLM_GPUS", "1,2")
    monkeypatch.setenv("TRAINER_GPUS", "1")
    monkeypatch.setenv(*BAD["proxy"])
    trainer = load_settings(TrainerSettings, learning_rate=0.5)  # a flag: the trainer's own value wins
    view = stack_view(trainer)
    assert (view.vllm_gpus, view.trainer_gpus, view.learning_rate) == ("1,2", "1", 0.5)
    assert view.proxy_routing == ProxySettings.model_fields["proxy_routing"].default  # unloadable: its default
    assert {"vllm_gpus", "trainer_gpus", "learning_rate"} <= view.model_fields_set
    assert "proxy_routing" not in view.model_fields_set
