"""A loaded task, and the error that names where a task file went wrong."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.settings import ConfigError

DATA_NAMES = ("train_dataset", "reward_funcs", "tools", "environment_factory", "eval_dataset")
MODULE_NAMES = ("defaults", "trl_args", "pass_threshold")
BUILD_FUNCTION = "build_task"
DEFAULT_PASS_THRESHOLD = 1.0


class TaskError(ConfigError):
    """One thing wrong with a task, as one line: `<file>:<line>: <what>; <what to do>` (line when known)."""

    def __init__(self, where: str, problem: str, line: int | None = None) -> None:
        self.where, self.problem, self.line = where, problem, line
        super().__init__(f"{where}:{line}: {problem}" if line else f"{where}: {problem}")


@dataclass(frozen=True)
class TaskSettings:
    """What a task says about the run before anything is built (read at settings time, no tokenizer needed)."""

    name: str  # TRAINER_TASK as given
    where: str  # the file (or module) errors name
    defaults: dict[str, Any] = field(default_factory=dict)
    trl_args: dict[str, Any] = field(default_factory=dict)
    pass_threshold: float = DEFAULT_PASS_THRESHOLD


@dataclass(frozen=True)
class Task:
    """Everything TRL is handed for one run, normalised (a single reward becomes a list, plain prompts messages)."""

    settings: TaskSettings
    train_dataset: Any
    reward_funcs: list[Callable[..., Any]]
    tools: list[Callable[..., Any]] = field(default_factory=list)
    environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None
    eval_dataset: Any = None
    tokenizer: Any = None  # the tokenizer the checks ran with (set by prepare_task)

    @property
    def where(self) -> str:
        return self.settings.where

    def summary(self) -> dict[str, Any]:
        """What the run trains on, for the start-up log line (reward names as TRL's metrics name them)."""
        from trl.trainer.utils import get_callable_name

        return {
            "task": self.settings.name, "task_file": self.where, "train_rows": len(self.train_dataset),
            "eval_rows": len(self.eval_dataset) if self.eval_dataset is not None else 0,
            "rewards": [get_callable_name(func) for func in self.reward_funcs],
            "tools": [getattr(tool, "__name__", "?") for tool in self.tools],
            "environment": self.environment_factory is not None,
        }

    def trainer_kwargs(self) -> dict[str, Any]:
        """The AsyncGRPOTrainer arguments this task sets (TRL's names)."""
        kwargs: dict[str, Any] = {"reward_funcs": self.reward_funcs or None, "train_dataset": self.train_dataset}
        if self.tools:
            kwargs["tools"] = self.tools
        if self.environment_factory is not None:
            kwargs["environment_factory"] = self.environment_factory
        return kwargs


def line_in(where: str, exc: BaseException) -> int | None:
    """The line of `where` (a file) the exception passed through last, if it did."""
    if isinstance(exc, SyntaxError) and exc.filename == where:
        return exc.lineno
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == where]
    return frames[-1].lineno if frames else None


def line_of(value: Any) -> int | None:
    """The line a function (or the function a partial wraps) is defined on, if its source is known."""
    value = getattr(value, "func", value)
    try:
        return inspect.getsourcelines(value)[1]
    except (OSError, TypeError):
        return None
