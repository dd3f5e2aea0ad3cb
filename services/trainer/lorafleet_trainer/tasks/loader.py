"""Find and import the task TRAINER_TASK names, and read what it provides (checks.py judges it).

TRAINER_TASK is a built-in name (math, jsonl, tiny: modules in builtin/), a path to a Python file (run as
`lorafleet_trainer.tasks.from_file`, see there why), or an importable module name. Every failure is a TaskError
naming the file and, where known, the line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from lorafleet.settings import ConfigError, TrainerSettings

from lorafleet_trainer.tasks.spec import (
    BUILD_FUNCTION,
    DATA_NAMES,
    DEFAULT_PASS_THRESHOLD,
    MODULE_NAMES,
    Task,
    TaskError,
    TaskSettings,
    line_in,
    line_of,
)

TASK_FILE_ENV = "LORAFLEET_TASK_FILE"
FILE_MODULE = "lorafleet_trainer.tasks.from_file"
BUILTIN_TASKS = ("math", "jsonl", "tiny")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def module_for(task: str) -> tuple[str, Path | None]:
    """(module to import, the task file or None) for a TRAINER_TASK value."""
    if task in BUILTIN_TASKS:
        return f"lorafleet_trainer.tasks.builtin.{task}", None
    if task.endswith(".py") or os.sep in task or "/" in task:
        path = Path(task).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"TRAINER_TASK={task}", f"no such file ({path}); give a path to a .py task file, "
                            f"a module name, or one of {', '.join(BUILTIN_TASKS)}")
        return FILE_MODULE, path
    if not _MODULE_NAME.fullmatch(task):
        raise TaskError(f"TRAINER_TASK={task}", "neither a built-in task, a .py file nor a module name")
    return task, None


def import_task(task: str) -> tuple[ModuleType, str]:
    """Import the task module (a task file is read afresh each time); returns (module, the file errors name)."""
    module_name, path = module_for(task)
    if path:
        os.environ[TASK_FILE_ENV] = str(path)  # before the import: spawned rollout processes and ranks inherit it
        sys.modules.pop(FILE_MODULE, None)
        where = str(path)
    else:
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise TaskError(task, "no module of that name: is it installed in the trainer's image, or did you mean "
                            "a file (give a path ending in .py)?")
        where = spec.origin or task
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TaskError(where, f"imports {exc.name!r}, which is not installed: add it to the trainer's image "
                        "(services/trainer) or put the module next to the task file", line_in(where, exc)) from None
    except SyntaxError as exc:
        raise TaskError(where, f"syntax error: {exc.msg}", line_in(where, exc)) from None
    except Exception as exc:
        raise TaskError(where, f"importing it raised {type(exc).__name__}: {exc}", line_in(where, exc)) from None
    return module, where


def read_task_settings(task: str) -> tuple[TaskSettings, ModuleType]:
    """The task's module-level `defaults`, `trl_args` and `pass_threshold`, checked (settings fields, TRL fields)."""
    module, where = import_task(task)
    defaults = getattr(module, "defaults", {})
    trl_args = getattr(module, "trl_args", {})
    threshold = getattr(module, "pass_threshold", DEFAULT_PASS_THRESHOLD)
    for name, value in (("defaults", defaults), ("trl_args", trl_args)):
        if not isinstance(value, Mapping):
            raise TaskError(where, f"`{name}` must be a dict, not {type(value).__name__}")
    unknown = sorted(set(defaults) - set(TrainerSettings.model_fields))
    if unknown:
        raise TaskError(where, f"`defaults` names {', '.join(unknown)}, which are not lorafleet settings the trainer "
                        "reads: use the common or trainer settings' names in lower case (learning_rate for "
                        "LEARNING_RATE); docs/reference/settings.md")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise TaskError(where, f"`pass_threshold` must be a number, not {type(threshold).__name__}")
    return TaskSettings(task, where, dict(defaults), dict(trl_args), float(threshold)), module


def _as_messages(dataset: Any) -> Any:
    """Plain-text prompts as one user message each (TRL renders every prompt as a message list)."""
    column_names = getattr(dataset, "column_names", None)
    if not column_names or "prompt" not in column_names or len(dataset) == 0 or not isinstance(
            dataset[0]["prompt"], str):
        return dataset
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})


def _normalise_dataset(value: Any) -> Any:
    """A list of row dicts becomes a datasets.Dataset; plain prompts become messages."""
    if isinstance(value, list) and value and all(isinstance(row, Mapping) for row in value):
        from datasets import Dataset

        value = Dataset.from_list([dict(row) for row in value])
    return _as_messages(value)


def build_task(task_settings: TaskSettings, module: ModuleType, tokenizer: Any, settings: TrainerSettings) -> Task:
    """Collect the task's data: module-level names, then whatever `build_task(tokenizer, settings)` returns."""
    where = task_settings.where
    provided = {name: getattr(module, name) for name in DATA_NAMES if hasattr(module, name)}
    build: Callable[..., Any] | None = getattr(module, BUILD_FUNCTION, None)
    if build is not None:
        if not callable(build):
            raise TaskError(where, f"`{BUILD_FUNCTION}` must be a function (tokenizer, settings) -> dict")
        try:
            built = build(tokenizer, settings)
        except ConfigError:  # a TaskError, or a setting the task refuses (naming it)
            raise
        except Exception as exc:
            raise TaskError(where, f"{BUILD_FUNCTION}() raised {type(exc).__name__}: {exc}",
                            line_in(where, exc) or line_of(build)) from None
        if not isinstance(built, Mapping):
            raise TaskError(where, f"{BUILD_FUNCTION}() returned {type(built).__name__}; return a dict with keys "
                            f"among {', '.join(DATA_NAMES)}", line_of(build))
        unknown = sorted(set(built) - set(DATA_NAMES))
        if unknown:
            raise TaskError(where, f"{BUILD_FUNCTION}() returned unknown keys {', '.join(unknown)}; the keys are "
                            f"{', '.join(DATA_NAMES)} ({', '.join(MODULE_NAMES)} are module-level names)",
                            line_of(build))
        twice = sorted(set(built) & set(provided))
        if twice:
            raise TaskError(where, f"{', '.join(twice)} given both at module level and by {BUILD_FUNCTION}(): "
                            "keep one", line_of(build))
        provided.update(built)
    if "train_dataset" not in provided:
        raise TaskError(where, f"no training data: define `train_dataset` (a datasets.Dataset with a `prompt` "
                        f"column) or return it from `{BUILD_FUNCTION}(tokenizer, settings)`")
    rewards = provided.get("reward_funcs") or []
    tools = provided.get("tools") or []
    return Task(
        settings=task_settings,
        train_dataset=_normalise_dataset(provided["train_dataset"]),
        reward_funcs=list(rewards) if isinstance(rewards, list | tuple) else [rewards],
        tools=list(tools) if isinstance(tools, list | tuple) else [tools],
        environment_factory=provided.get("environment_factory"),
        eval_dataset=_normalise_dataset(provided["eval_dataset"]) if provided.get("eval_dataset") is not None
        else None,
    )
