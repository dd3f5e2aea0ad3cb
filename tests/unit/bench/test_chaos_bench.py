"""`make chaos` rebuilds the form a failure message names: the replay command is exact, not a neighbouring form."""

from __future__ import annotations

import argparse

import pytest
from chaos import form_from, main, options
from lorafleet_testing.chaos.judge import Report, Violation, render
from lorafleet_testing.chaos.trial import FORMS, ci_form


def args(*argv: str) -> argparse.Namespace:
    return options().parse_args(list(argv))


@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_named_form_make_chaos_builds_is_the_one_whose_replay_names_it(name: str) -> None:
    form = FORMS[name](55)
    assert form.replay == f"make chaos SEED=55 FORM={name}"
    assert form_from(args("--seed", "55", "--form", name), no_disk=None) == form


def test_the_integration_tiers_form_replays_with_form_ci_and_the_default_form_without() -> None:
    assert ci_form(55).replay == "make chaos SEED=55 FORM=ci"
    default = form_from(args("--seed", "55"), no_disk=None)
    assert default.replay == "make chaos SEED=55" and default != ci_form(55)


def test_a_failure_prints_the_forms_own_replay_command() -> None:
    broken = [Violation("finished", "a", "the last start exited 1", None)]
    report = Report(seed=55, schedule=[], violations=broken, replay=ci_form(55).replay)
    assert "replay: make chaos SEED=55 FORM=ci" in render(report)
    older = Report(seed=55, schedule=[], violations=broken)  # a folder from before the manifest named its replay
    assert "replay: make chaos SEED=55\n" in render(older)


def test_a_named_form_and_the_long_form_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--form", "ci", "--minutes", "5"])
    assert exited.value.code == 2 and "--form" in capsys.readouterr().err
