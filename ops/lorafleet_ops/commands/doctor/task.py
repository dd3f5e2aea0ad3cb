"""`lorafleet doctor --task FILE`: the trainer's task checks with no fleet at all, one row per problem.

The checks live with the trainer (lorafleet_trainer.tasks.checks: TRL, transformers and the task's own imports are
needed); this module only runs them and turns each problem into a FAIL row. Where the trainer is not installed (the
proxy's image) the row says where to run it instead.
"""

from __future__ import annotations

from lorafleet.settings import ConfigError

from lorafleet_ops.commands.doctor.model import CheckResult, Status

WHERE_TO_RUN = ("run it where the trainer runs: `make doctor TASK=tasks/FILE.py` (the trainer's image), or .venv's "
                "`lorafleet doctor --task FILE`")


def check_task_file(task: str) -> list[CheckResult]:
    """PASS with what the task provides, or a FAIL per problem (file:line: what; what to do)."""
    try:
        from lorafleet_trainer.main import resolve_settings
        from lorafleet_trainer.tasks.checks import TaskProblems, prepare_task
    except ImportError as exc:
        return [CheckResult("task", Status.FAIL, f"the trainer package is not installed here ({exc.name})",
                            WHERE_TO_RUN)]
    try:
        settings = resolve_settings({"trainer_task": task})
        loaded, _ = prepare_task(settings)
    except TaskProblems as problems:
        return [CheckResult("task", Status.FAIL, str(problem)) for problem in problems.problems]
    except ConfigError as exc:
        return [CheckResult("task", Status.FAIL, line) for line in str(exc).splitlines() if line.strip()]
    summary = loaded.summary()
    described = (f"{summary['task_file']}: {summary['train_rows']} training rows, {summary['eval_rows']} eval rows, "
                 f"rewards {', '.join(summary['rewards']) or '(the environment)'}"
                 + (f", tools {', '.join(summary['tools'])}" if summary["tools"] else "")
                 + (", an environment" if summary["environment"] else ""))
    return [CheckResult("task", Status.PASS, described)]
