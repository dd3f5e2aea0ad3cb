"""Score the task's eval set through the fleet while training: greedy, with the adapter version just published.

Every EVAL_EVERY_STEPS steps (and after step 1, the baseline) the main process starts one pass over `eval_dataset`
in a thread of its own: each row is one greedy episode (tools and environments as in training, turns up to the task's
`max_tool_calling_iterations`, at most MAX_EVAL_TURNS) sent to TRAINER_VLLM_URL with the run key, like any rollout:
evaluation is traffic, never a pause. The task's rewards score it (guarded, tasks/guards.py). A row passes when its
summed reward is at or above the task's `pass_threshold`. The result rides on the next logged training step
(`eval/pass_at_1`, `eval/reward`, `eval/rewards/<function>`, `eval/nonzero/<function>` (how often a function
scored at all: a 0-or-x reward's hit rate, e.g. a format rate), `eval/step`, `eval/model_version`), so metrics.jsonl,
Prometheus and the demo's report get it as they get the training reward; a pass still running when training ends
(the last step's) gets up to FINAL_WAIT_S and its own metrics.jsonl line. One pass at a time: a slow one is not
stacked on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from lorafleet.logs import log_event
from lorafleet.settings import TrainerSettings
from transformers import TrainerCallback
from trl.trainer.utils import get_callable_name

from lorafleet_trainer.proxy_client import ProxyClient
from lorafleet_trainer.tasks.checks import environment_tools
from lorafleet_trainer.tasks.guards import FaultLog, guard_environment, guard_reward, guard_tool
from lorafleet_trainer.tasks.spec import Task

log = logging.getLogger("lorafleet_trainer.evaluation")

MAX_EVAL_TURNS = 8
FINAL_WAIT_S = 300.0  # at the end of training, how long a pass still running may finish (then it is dropped)
CONCURRENCY = 16
TRL_ARGUMENTS = ("prompt", "completion", "completion_ids")
POLICY = "trl-policy"  # TRL's adapter name prefix: version N is served as trl-policy-vN


@dataclass
class EvalResult:
    """One pass over the eval set with one adapter version."""

    step: int
    model_version: int
    rows: int
    passed: int
    reward: float | None
    by_function: dict[str, float | None] = field(default_factory=dict)
    nonzero: dict[str, float] = field(default_factory=dict)  # per function: the share of rows it scored above 0
    failed_requests: int = 0
    duration_s: float = 0.0

    @property
    def pass_at_1(self) -> float:
        return self.passed / self.rows if self.rows else 0.0

    def as_logs(self) -> dict[str, float]:
        logs = {"eval/pass_at_1": self.pass_at_1, "eval/step": float(self.step),
                "eval/model_version": float(self.model_version), "eval/rows": float(self.rows),
                "eval/failed_requests": float(self.failed_requests), "eval/duration_s": round(self.duration_s, 3)}
        if self.reward is not None:
            logs["eval/reward"] = self.reward
        logs.update({f"eval/rewards/{name}": value for name, value in self.by_function.items() if value is not None})
        logs.update({f"eval/nonzero/{name}": value for name, value in self.nonzero.items()})
        return logs


def _mean(values: list[float | None]) -> float | None:
    numbers = [value for value in values if value is not None]
    return sum(numbers) / len(numbers) if numbers else None


class Evaluator:
    """Greedy episodes of the eval set through the fleet, scored with the task's rewards."""

    def __init__(self, task: Task, settings: TrainerSettings, run_key: str) -> None:
        self.task, self.settings, self.run_key = task, settings, run_key
        self.faults = FaultLog()
        self.turns = min(int(task.settings.trl_args.get("max_tool_calling_iterations") or MAX_EVAL_TURNS),
                         MAX_EVAL_TURNS)

    async def evaluate(self, step: int, model_version: int) -> EvalResult:
        started = time.monotonic()
        rows = [self.task.eval_dataset[index] for index in range(len(self.task.eval_dataset))]
        limit = asyncio.Semaphore(CONCURRENCY)
        proxy = ProxyClient.from_settings(self.settings, self.run_key)
        async with proxy.http(timeout=self.settings.trainer_server_timeout_s) as client:
            async def bounded(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int], float | None, bool]:
                async with limit:
                    return await self.episode(client, row, f"{POLICY}-v{model_version}")

            episodes = await asyncio.gather(*(bounded(row) for row in rows))
        scores = await self.score(rows, episodes)
        by_function = {name: _mean(values) for name, values in scores.items()}
        totals = [self.total([values[index] for values in scores.values()]) for index in range(len(rows))]
        return EvalResult(
            step=step, model_version=model_version, rows=len(rows),
            passed=sum(total is not None and total >= self.task.settings.pass_threshold for total in totals),
            reward=_mean(totals), by_function=by_function,
            nonzero={name: sum(value is not None and value > 0 for value in values) / len(rows)
                     for name, values in scores.items() if rows},
            failed_requests=sum(not ok for *_, ok in episodes), duration_s=time.monotonic() - started)

    @staticmethod
    def total(scores: list[float | None]) -> float | None:
        """A row's reward as TRL sums it: None only when no function scored it."""
        numbers = [score for score in scores if score is not None and not math.isnan(score)]
        return sum(numbers) if numbers else None

    async def score(self, rows: list[dict[str, Any]], episodes: list[Any]) -> dict[str, list[float | None]]:
        """Each reward function over all rows, as TRL calls it for a group; the environment's reward alongside."""
        kwargs: dict[str, Any] = {
            "completions": [completion for completion, *_ in episodes],
            "prompts": [row.get("prompt") for row in rows],
            "completion_ids": [ids for _, ids, *_ in episodes],
        }
        for column in rows[0] if rows else {}:
            if column not in TRL_ARGUMENTS:
                kwargs[column] = [row[column] for row in rows]
        scores: dict[str, list[float | None]] = {}
        for func in self.task.reward_funcs:
            name = get_callable_name(func)  # TRL's name: eval/rewards/<name> pairs with rewards/<name>
            scores[name] = await guard_reward(func, name, self.settings.task_timeout_s, self.faults)(**kwargs)
        if any(reward is not None for *_, reward, _ in episodes):
            scores["environment"] = [reward for *_, reward, _ in episodes]
        return scores

    async def episode(self, client: httpx.AsyncClient, row: dict[str, Any], model: str,
                      ) -> tuple[list[dict[str, Any]], list[int], float | None, bool]:
        """(completion messages, generated ids, the environment's reward, every request answered)."""
        from trl.chat_template_utils import parse_response

        tokenizer, timeout_s = self.task.tokenizer, self.settings.task_timeout_s
        tools = list(self.task.tools)
        messages = list(row.get("prompt") or [{"role": "user", "content": ""}])
        environment = None
        factory = self.task.environment_factory
        if factory is not None:
            factory = factory[row["environment"]] if isinstance(factory, dict) else factory
            environment = guard_environment(factory(), timeout_s, self.faults)
            observation = environment.reset(**{key: value for key, value in row.items() if key != "environment"})
            tools += environment_tools(environment)
            if isinstance(observation, str) and observation:
                messages[-1] = {**messages[-1], "content": str(messages[-1]["content"]) + observation}
        by_name = {getattr(tool, "__name__", ""): tool for tool in tools}
        completion: list[dict[str, Any]] = []
        generated: list[int] = []
        answered = True
        for turn in range(self.turns + 1):
            prompt_ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                       return_dict=False)
            try:
                response = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt_ids, "max_tokens": self.settings.max_completion_length,
                    "temperature": 0.0, "n": 1, "return_token_ids": True})
                response.raise_for_status()
                ids = list(response.json()["choices"][0]["token_ids"])
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                log.warning("eval request failed (%s: %s): the row scores what it has so far", type(exc).__name__, exc)
                answered = False
                break
            message = parse_response(tokenizer, ids, prefix=prompt_ids, tools=tools or None)
            completion.append(message)
            messages.append(message)
            generated += ids
            calls = message.get("tool_calls")
            if not calls or turn == self.turns:
                break
            for call in calls:
                name = call["function"]["name"]
                tool = by_name.get(name)
                try:
                    if tool is None:
                        raise KeyError(f"unknown tool {name}")
                    result = await guard_tool(tool, name, timeout_s, self.faults)(**call["function"].get(
                        "arguments", {}))
                except Exception as exc:  # as TRL answers a failed call: the error goes back to the model
                    result = {"error": str(exc)}
                reply = {"role": "tool", "name": name, "content": str(result)}
                completion.append(reply)
                messages.append(reply)
        reward = environment.get_reward() if environment is not None and hasattr(environment, "get_reward") else None
        return completion, generated, reward, answered


class EvalCallback(TrainerCallback):
    """Starts an eval pass after step 1 and every `every` steps (main process), logs it with the next step."""

    def __init__(self, evaluator: Evaluator, every: int, write: Callable[[int, dict[str, Any]], None]) -> None:
        self.evaluator, self.every, self.write = evaluator, every, write
        self.trainer: Any = None  # bound after the trainer is built: the published version is the trainer's
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._running: threading.Thread | None = None

    def bind(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        step = state.global_step
        if not state.is_world_process_zero or self.trainer is None or not (step == 1 or step % self.every == 0):
            return
        if self._running is not None and self._running.is_alive():
            log_event(log, "eval_skipped", logging.WARNING, step=step, reason="the previous eval pass is running")
            return
        version = int(self.trainer.model_version)
        self._running = threading.Thread(target=self._run, args=(step, version), daemon=True, name="lorafleet-eval")
        self._running.start()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if logs is None:
            return
        with self._lock:
            logs.update(self._pending)
            self._pending = {}

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        """The last pass (started at the last step) finishes and is written on a line of its own."""
        if self._running is not None:
            self._running.join(FINAL_WAIT_S)
            if self._running.is_alive():
                log_event(log, "eval_dropped", logging.WARNING, reason=f"still running after {FINAL_WAIT_S:.0f}s")
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            self.write(state.global_step, pending)

    def _run(self, step: int, version: int) -> None:
        try:
            result = asyncio.run(self.evaluator.evaluate(step, version))
        except Exception as exc:  # evaluation must never stop training
            log_event(log, "eval_failed", logging.ERROR, step=step, reason=f"{type(exc).__name__}: {exc}")
            return
        log_event(log, "eval", step=step, model_version=version, rows=result.rows,
                  pass_at_1=round(result.pass_at_1, 4),
                  reward=None if result.reward is None else round(result.reward, 4),
                  failed_requests=result.failed_requests, duration_s=round(result.duration_s, 1))
        with self._lock:
            self._pending = result.as_logs()


def eval_callbacks(task: Task, settings: TrainerSettings, run_key: str, main_rank: bool,
                   write: Callable[[int, dict[str, Any]], None]) -> list[EvalCallback]:
    """[EvalCallback] when the task has an eval set, EVAL_EVERY_STEPS is set and this is the main process; `write`
    appends a metrics.jsonl line (MetricsJsonl.append) for the pass the end of training would otherwise lose."""
    if not main_rank or task.eval_dataset is None or settings.eval_every_steps <= 0:
        return []
    return [EvalCallback(Evaluator(task, settings, run_key), settings.eval_every_steps, write)]
