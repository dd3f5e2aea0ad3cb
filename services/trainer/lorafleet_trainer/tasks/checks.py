"""Judge a task before anything touches the fleet: every problem as one line naming the file, the line, the fix.

The trainer runs these before it asks the fleet anything (a broken task never pauses, loads or unloads), and
`lorafleet doctor --task FILE` runs them with no fleet at all. What TRL would only find out in its spawned rollout
process (an unpicklable reward, a tool without a docstring, a template that drops the tools) is found here.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from lorafleet.settings import ConfigError, TrainerSettings
from trl.trainer.utils import get_callable_name

from lorafleet_trainer.tasks.guards import call_with_timeout, clean_score, clean_scores
from lorafleet_trainer.tasks.loader import build_task, read_task_settings
from lorafleet_trainer.tasks.spec import Task, TaskError, TaskSettings, line_in, line_of

DUMMY_COMPLETION = "The answer is 42."
TRL_REWARD_ARGUMENTS = ("completions", "prompts", "completion_ids")
DRY_RUN_ROWS = 2
TOOLS_HELP = "docs/guides/tasks.md#tools-and-multi-turn-environments"


class TaskProblems(ConfigError):
    """Everything wrong with a task, one line each."""

    def __init__(self, problems: list[TaskError]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(problem) for problem in problems))


def _picklable(value: Any, what: str, where: str) -> list[TaskError]:
    try:
        pickle.dumps(value)
    except Exception as exc:
        return [TaskError(where, f"{what} cannot be pickled ({type(exc).__name__}: {exc}); TRL sends it to its "
                          "rollout process by name: define it at module level (no lambda, closure or nested "
                          "function), or use functools.partial of one", line_of(value))]
    return []


def check_dataset(dataset: Any, what: str, where: str, *, prompt_required: bool = True) -> list[TaskError]:
    """A non-empty datasets.Dataset whose `prompt` column holds message lists (plain text was converted)."""
    if isinstance(dataset, list | tuple) and not dataset:
        return [TaskError(where, f"`{what}` is empty; it needs at least one row")]
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        return [TaskError(where, f"`{what}` is a {type(dataset).__name__}; give a datasets.Dataset (or a list of row "
                          "dicts) with a `prompt` column")]
    if len(dataset) == 0:
        return [TaskError(where, f"`{what}` is empty; it needs at least one row")]
    if "prompt" not in dataset.column_names:
        if prompt_required:
            return [TaskError(where, f"`{what}` has no `prompt` column (columns: {', '.join(dataset.column_names)}); "
                              "name the column holding the prompt `prompt`")]
        return []
    prompt = dataset[0]["prompt"]
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(message, Mapping) and "role" in message and "content" in message for message in prompt)):
        return [TaskError(where, f"`{what}` row 0: `prompt` is {prompt!r:.80}; give text or a list of "
                          "{'role': ..., 'content': ...} messages")]
    return []


def _environment_factories(task: Task) -> dict[str, Callable[[], Any]]:
    factory = task.environment_factory
    if factory is None:
        return {}
    return dict(factory) if isinstance(factory, Mapping) else {"environment_factory": factory}


def _environment(factory: Callable[[], Any], label: str, where: str) -> tuple[Any, list[TaskError]]:
    """One instance of the environment, as TRL's rollout process builds it to list its tools."""
    if not callable(factory):
        return None, [TaskError(where, f"`{label}` is a {type(factory).__name__}; give a class or a function that "
                                "returns an environment")]
    try:
        instance = factory()
    except Exception as exc:
        return None, [TaskError(where, f"`{label}()` raised {type(exc).__name__}: {exc}",
                                line_in(where, exc) or line_of(factory))]
    if not callable(getattr(instance, "reset", None)):
        return None, [TaskError(where, f"the environment `{label}` builds ({type(instance).__name__}) has no "
                                "`reset(self, **row)` method; TRL calls it before every episode", line_of(factory))]
    return instance, []


def environment_tools(instance: Any) -> list[Callable[..., Any]]:
    """The environment's public methods, which TRL offers the model as tools."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def check_tool(tool: Any, where: str) -> list[TaskError]:
    """Callable, picklable (unless bound to an environment) and described the way transformers builds its schema."""
    from transformers.utils import get_json_schema

    name = get_callable_name(tool)
    if not callable(tool):
        return [TaskError(where, f"tool {tool!r:.60} is not callable; give a function")]
    problems = [] if inspect.ismethod(tool) else _picklable(tool, f"tool `{name}`", where)
    if problems:
        return problems
    if not inspect.ismethod(tool) and not inspect.isfunction(tool):
        problems.append(TaskError(where, f"tool `{name}` is a {type(tool).__name__}; TRL registers tools by "
                                  "`__name__`: give a module-level function"))
        return problems
    try:
        get_json_schema(tool)
    except Exception as exc:
        problems.append(TaskError(where, f"tool `{name}`: {exc} (type hints on every argument and a docstring with "
                                  f"an Args section describing each; {TOOLS_HELP})", line_of(tool)))
    return problems


def _dry_run_kwargs(task: Task, tokenizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """TRL's reward arguments for the first rows, each with one dummy completion."""
    rows = [task.train_dataset[index] for index in range(min(DRY_RUN_ROWS, len(task.train_dataset)))]
    ids = tokenizer.encode(DUMMY_COMPLETION, add_special_tokens=False)
    kwargs: dict[str, Any] = {
        "completions": [[{"role": "assistant", "content": DUMMY_COMPLETION}] for _ in rows],
        "prompts": [row.get("prompt") for row in rows],  # TRL_REWARD_ARGUMENTS, then the columns
        "completion_ids": [list(ids) for _ in rows],
    }
    for column in rows[0]:
        if column not in ("prompt", "completion", "completion_ids"):
            kwargs[column] = [row[column] for row in rows]
    return kwargs, rows


def check_reward_call(func: Any, kwargs: dict[str, Any], where: str, timeout_s: float) -> list[TaskError]:
    """Call one reward as TRL does, on the dry-run rows: it must answer one score (or None) per completion."""
    name = get_callable_name(func)
    expected = len(kwargs["completions"])
    try:
        values = call_with_timeout(func, timeout_s, **kwargs)
    except TimeoutError:
        return [TaskError(where, f"reward `{name}` did not return within TASK_TIMEOUT_S={timeout_s:g}s on "
                          f"{expected} dummy completions", line_of(func))]
    except Exception as exc:
        columns = ", ".join(key for key in kwargs if key not in TRL_REWARD_ARGUMENTS) or "none"
        return [TaskError(where, f"reward `{name}` raised {type(exc).__name__}: {exc} on {expected} dummy "
                          "completions, called as TRL calls it (keyword arguments completions, prompts, "
                          f"completion_ids and the dataset's columns: {columns}; accept **kwargs for the rest)",
                          line_in(where, exc) or line_of(func))]
    _, problem = clean_scores(values, expected)
    if problem:
        return [TaskError(where, f"reward `{name}` {problem} on dummy completions: return one float (or None) per "
                          "completion", line_of(func))]
    return []


def check_rewards(task: Task, tokenizer: Any, settings: TrainerSettings, rewarding_envs: list[str]) -> list[TaskError]:
    where = task.where
    if not task.reward_funcs and not rewarding_envs:
        return [TaskError(where, "no reward: define `reward_funcs` (a list of functions) or give the environment a "
                          "`get_reward(self)` method")]
    problems: list[TaskError] = []
    kwargs, _ = _dry_run_kwargs(task, tokenizer)
    for func in task.reward_funcs:
        if not callable(func):
            problems.append(TaskError(where, f"reward {func!r:.60} is not callable; give functions in `reward_funcs`"))
            continue
        found = _picklable(func, f"reward `{get_callable_name(func)}`", where)
        problems += found or check_reward_call(func, kwargs, where, settings.task_timeout_s)
    return problems


def check_environments(task: Task, settings: TrainerSettings
                       ) -> tuple[list[Callable[..., Any]], list[str], list[TaskError]]:
    """(tools the environments offer, environments with get_reward, problems); one episode of each is run."""
    tools: list[Callable[..., Any]] = []
    rewarding: list[str] = []
    problems: list[TaskError] = []
    where = task.where
    row = {key: value for key, value in task.train_dataset[0].items() if key != "environment"}
    for label, factory in _environment_factories(task).items():
        problems += _picklable(factory, f"environment factory `{label}`", where)
        instance, found = _environment(factory, label, where)
        problems += found
        if instance is None:
            continue
        tools += environment_tools(instance)
        try:
            call_with_timeout(instance.reset, settings.task_timeout_s, **row)
        except Exception as exc:
            problems.append(TaskError(where, f"`{type(instance).__name__}.reset(**row 0)` raised "
                                      f"{type(exc).__name__}: {exc}; TRL passes every dataset column as a keyword "
                                      "(accept **kwargs)", line_in(where, exc) or line_of(instance.reset)))
            continue
        if callable(getattr(type(instance), "get_reward", None)):
            rewarding.append(type(instance).__name__)
            get_reward = instance.get_reward
            try:
                value = call_with_timeout(get_reward, settings.task_timeout_s)
            except Exception as exc:
                problems.append(TaskError(where, f"`{type(instance).__name__}.get_reward()` after reset raised "
                                          f"{type(exc).__name__}: {exc}", line_in(where, exc) or line_of(get_reward)))
                continue
            if value is not None and clean_score(value) is None:
                problems.append(TaskError(where, f"`{type(instance).__name__}.get_reward()` returned {value!r:.40}; "
                                          "return a float (or None)", line_of(get_reward)))
    return tools, rewarding, problems


def check_template(task: Task, tokenizer: Any, tools: list[Callable[..., Any]],
                   settings: TrainerSettings) -> list[TaskError]:
    """The chat template must show the model every tool, and keep earlier turns unchanged (TRL's multi-turn loop)."""
    if not tools:
        return []
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    prompt = task.train_dataset[0].get("prompt") or [{"role": "user", "content": ""}]
    try:
        rendered = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        return [TaskError(task.where, f"BASE_MODEL's chat template cannot render the tools: {type(exc).__name__}: "
                          f"{exc}")]
    missing = [get_callable_name(tool) for tool in tools if get_callable_name(tool) not in rendered]
    if missing:
        return [TaskError(task.where, f"BASE_MODEL ({settings.base_model})'s chat template does not render the "
                          f"tools {', '.join(missing)}: the model would never see them; use a model whose template "
                          f"renders `tools` ({TOOLS_HELP})")]
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            training_template = get_training_chat_template(tokenizer)
        except Exception:
            training_template = None
        if training_template is None:
            return [TaskError(task.where, f"BASE_MODEL ({settings.base_model})'s chat template rewrites earlier turns "
                              "and TRL has no training template for it: multi-turn tool use cannot train on it")]
    return []


def check_trl_args(task_settings: TaskSettings, settings: TrainerSettings) -> list[TaskError]:
    """Fields of TRL 1.16's AsyncGRPOConfig, and none that lorafleet sets from its own settings."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from lorafleet_trainer.config import lorafleet_fields, refuse_clashes

    known = {item.name for item in dataclasses.fields(AsyncGRPOConfig)}
    unknown = sorted(set(task_settings.trl_args) - known)
    if unknown:
        return [TaskError(task_settings.where, f"`trl_args` names {', '.join(unknown)}, which AsyncGRPOConfig "
                          "(TRL 1.16) does not have")]
    try:
        refuse_clashes(task_settings.trl_args, lorafleet_fields(settings))
    except ConfigError as exc:
        return [TaskError(task_settings.where, str(exc).replace("the task's trl_args", "`trl_args`"))]
    return []


def check_task(task: Task, tokenizer: Any, settings: TrainerSettings) -> list[TaskError]:
    """Every problem with `task`, in the order a user fixes them (data, environments, rewards, tools, template)."""
    problems = check_trl_args(task.settings, settings) + check_dataset(
        task.train_dataset, "train_dataset", task.where, prompt_required=task.environment_factory is None)
    if task.eval_dataset is not None:
        problems += check_dataset(task.eval_dataset, "eval_dataset", task.where)
    if problems:
        return problems  # the rest runs on the data
    env_tools, rewarding, problems = check_environments(task, settings)
    problems += check_rewards(task, tokenizer, settings, rewarding)
    for tool in task.tools:
        problems += check_tool(tool, task.where)
    for tool in env_tools:
        problems += check_tool(tool, task.where)
    if not problems:
        problems += check_template(task, tokenizer, [*task.tools, *env_tools], settings)
    return problems


def prepare_task(settings: TrainerSettings, tokenizer: Any = None) -> tuple[Task, Any]:
    """(the checked task, its tokenizer) for `settings`; TaskProblems lists everything wrong."""
    from lorafleet_trainer.recipes import load_tokenizer

    task_settings, module = read_task_settings(settings.trainer_task)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(settings.base_model)
        except ConfigError:
            raise
        except Exception as exc:  # not downloadable, not a model folder: the task cannot be rendered without it
            raise ConfigError(f"BASE_MODEL: cannot load the tokenizer of {settings.base_model!r} to check the task "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); set BASE_MODEL to the "
                              "model you train (a local folder, or a Hub name reachable from here)") from None
    task = build_task(task_settings, module, tokenizer, settings)
    problems = check_task(task, tokenizer, settings)
    if problems:
        raise TaskProblems(problems)
    return dataclasses.replace(task, tokenizer=tokenizer), tokenizer
