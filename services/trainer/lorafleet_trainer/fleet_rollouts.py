"""TRL's rollout requests as the fleet needs them: the run key on each, and a bounded, logged wait for the fleet.

TRL 1.16's `AsyncRolloutWorker` has no header setting and retries a completion a fixed 30 times (1 to 16 s apart,
~7 min, each try itself 3 quick attempts), whatever the operator wants. Its worker spawns a child process that
builds `worker._loop_cls(**worker._loop_kwargs, ...)` and posts every completion through the `aiohttp.ClientSession`
that `_AsyncRolloutLoop._run_loops` opens; a patch made in the parent never reaches a spawned child. So the loop class
becomes `FleetRolloutLoop` (pickled by reference: the child imports it from this module) and its settings ride in
`_loop_kwargs` (pickled through the spawn pipe, never an environment variable):

- the run key (TRAINER_RUN_KEY_FILE) is set as a default header of the session the moment TRL stores it in
  `self.session`, so every request on it carries the key and TRL's own code runs unchanged;
- a completion that cannot reach the fleet (refused, reset, timed out, a 5xx, a 408/429) is retried every
  `RETRY_MAX_S` at most until TRAINER_FLEET_WAIT_S has passed since its first failure, each retry logged with the
  time waited; other 4xx answers are final (a retry cannot mend a refused key or a bad request);
- the task's rewards, tools and environments run guarded (tasks/guards.py: TASK_TIMEOUT_S, faults counted);
- each multi-turn episode asks for the adapter version episodes.py chooses (TRAINER_PIN_EPISODES);
- prompt groups are named by their position in the prompt stream and a resumed child starts where the checkpoint's
  consumed prompts end, skipping those consumed past it (resume.py);
- each completion's provenance headers (which replica answered, under which adapter name and fingerprint) are noted
  per turn on its episode, and each scored sample is a `ProvenancedSample` carrying its rollout's answers to the
  trainer process (provenance.py).

TRL's private names are checked at start: a TRL without them refuses to start (a config error) rather than sending
no key or giving up early. A module of its own because it imports TRL's rollout worker at load time.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import aiohttp
from lorafleet.settings import ConfigError, TrainerSettings
from trl.experimental.async_grpo import async_rollout_worker as trl_worker

from lorafleet_trainer import trl_seam
from lorafleet_trainer.episodes import CURRENT, MIXED_METRIC, Episode
from lorafleet_trainer.provenance import Answer, answer_from
from lorafleet_trainer.proxy_client import ProxyClient
from lorafleet_trainer.tasks.guards import FaultLog, guard_environment, guard_reward, guard_tool

log = logging.getLogger("lorafleet_trainer.rollouts")  # not TRL's: accelerate's logger raises before PartialState()

RUN_KEY_KWARG = "run_key"  # the loop kwargs that carry our settings into the child
FLEET_WAIT_KWARG = "fleet_wait_s"
TASK_TIMEOUT_KWARG = "task_timeout_s"
PIN_EPISODES_KWARG = "pin_episodes"
MAX_STALENESS_KWARG = "max_staleness"
RESUME_START_KWARG = "resume_start"  # set by resume.PromptTracker.bind
RESUME_SKIP_KWARG = "resume_skip"
RETRY_MAX_S = 5.0  # back on the fleet within seconds of its return
RETRY_STATUSES = frozenset({408, 429})  # the 4xx answers that say "later", not "no"
COMPLETIONS_LABEL = "vllm /v1/completions"  # TRL's label of its outer, per-completion retry
COMPLETIONS_PATH = "/v1/completions"
# TRL's loop class; `object` only so that a TRL without it still imports this module and check_rollout_hooks says so.
_TRL_LOOP: Any = getattr(trl_worker, "_AsyncRolloutLoop", object)
_TRL_SAMPLE: Any = getattr(trl_worker, "RolloutSample", object)
_RETRYABLE: tuple[type[BaseException], ...] = getattr(trl_worker, "_RETRYABLE_HTTP_ERRORS", (aiohttp.ClientError,))


@dataclass(slots=True)
class ProvenancedSample(_TRL_SAMPLE):
    """TRL's scored sample with who answered each turn of its rollout (pickled by reference, like the loop)."""

    answers: tuple[Answer, ...] = ()


class RolloutsUnsupported(RuntimeError):
    """The trainer's rollout worker is not the TRL 1.16 worker this module wires into."""


def retryable(exc: BaseException) -> bool:
    """Whether another try may succeed: the fleet unreachable or failing, not a 4xx that says no."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status >= 500 or exc.status in RETRY_STATUSES
    return isinstance(exc, _RETRYABLE)


def stream_positions(start: int, skip: Iterable[int]) -> Iterator[int]:
    """The prompt-stream positions from `start` on, less `skip`: what a resumed rollout child generates, in order."""
    skipped = frozenset(skip)
    position = start
    while True:
        if position not in skipped:
            yield position
        position += 1


class FleetRolloutLoop(_TRL_LOOP):
    """TRL's rollout loop whose session sends the run key, whose completions wait for the fleet, whose task code
    runs guarded, whose episodes keep their adapter version and whose groups are prompt-stream positions (in the
    child)."""

    def __init__(self, *, run_key: str = "", fleet_wait_s: float = 600.0, task_timeout_s: float = 60.0,
                 pin_episodes: bool = True, max_staleness: int = 4, resume_start: int = 0,
                 resume_skip: Iterable[int] = (), **loop_kwargs: Any) -> None:
        self._resume_start = resume_start
        self._resume_skip = tuple(resume_skip)
        self._run_key = run_key  # before TRL's __init__, which assigns self.session
        self._fleet_wait_s = fleet_wait_s
        self._task_timeout_s = task_timeout_s
        self._pin_episodes = pin_episodes
        self._max_staleness = max_staleness
        self._faults = FaultLog()
        self._answers: dict[str, tuple[Answer, ...]] = {}  # rollout id -> its answers, until its group is scored
        super().__init__(**loop_kwargs)  # probes one instance of each environment: guarded below
        self.reward_funcs = [guard_reward(func, name, task_timeout_s, self._faults)
                             for func, name in zip(self.reward_funcs, self.reward_func_names, strict=False)]
        if self.environment_factories is not None:
            for instances in self._environment_pool.values():
                for instance in instances:
                    guard_environment(instance, task_timeout_s, self._faults)
            self.environment_factories = {name: _GuardedFactory(factory, task_timeout_s, self._faults)
                                          for name, factory in self.environment_factories.items()}

    def _repeat_iterator(self) -> Iterator[tuple[int, Any]]:
        """TRL's walk over the dataset in row order, each group named by its stream position (epoch × rows + row),
        from `resume_start` on, less `resume_skip`. A dataset without a length (streaming) keeps TRL's walk."""
        if not hasattr(self.dataset, "__len__"):
            yield from super()._repeat_iterator()
            return
        rows = len(self.dataset)
        for position in stream_positions(self._resume_start, self._resume_skip):
            row = self.dataset[position % rows]
            for _ in range(self.num_generations):
                yield position, row

    @property
    def _request_model(self) -> str:
        """The adapter this turn decodes with: the episode's (episodes.py), not always the newest."""
        if self.lora_name is None:
            return self.model_name
        episode = CURRENT.get()
        version = self.model_version
        if episode is not None:
            version = episode.version_for(version, pin=self._pin_episodes, max_staleness=self._max_staleness)
        return f"{self.lora_name}-v{version}"

    async def _generate_one(self, prompt: Any, tool_dict: dict[str, Callable[..., Any]], tools: list[Any],
                            group_id: int = 0) -> Any:
        episode = Episode()
        CURRENT.set(episode)  # this rollout's own task: the context is its copy
        result = await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)
        for sequence in result[2]:  # TRL's training rows of this rollout, all under its rollout id
            self._answers[sequence.rollout_id] = tuple(episode.answers)
        if episode.multi_turn:
            self._rates[MIXED_METRIC][0] += episode.mixed
            self._rates[MIXED_METRIC][1] += 1
        return result

    async def _score_group(self, group: Any) -> list[Any]:
        """TRL's samples, each with its rollout's answers: TRL builds one sample per training row, in row order."""
        samples = await super()._score_group(group)
        rows = [sequence for sequences in group.completions_sequences for sequence in sequences]
        return [ProvenancedSample(**{f.name: getattr(sample, f.name) for f in fields(_TRL_SAMPLE)},
                                  answers=self._answers.pop(row.rollout_id, ()))
                for sample, row in zip(samples, rows, strict=True)]

    async def _post(self, path: str, payload: dict[str, Any], timeout: float, max_retries: int = 3) -> Any:
        """TRL's POST; a completion's answer is also noted, with its provenance headers, on the rollout's episode."""
        if path != COMPLETIONS_PATH:
            return await super()._post(path, payload, timeout, max_retries)
        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def post() -> Any:
            async with self.session.post(f"{self.vllm_server_url}{path}", json=payload,
                                         timeout=client_timeout) as response:
                response.raise_for_status()
                content = await response.json() or {}
            if (episode := CURRENT.get()) is not None:
                episode.answers.append(answer_from(response.headers, content))
            return content

        return await self._retry(post, label=f"POST {path}", max_attempts=max_retries)

    async def _execute_tool_calls(self, tool_calls: list[dict[str, Any]],
                                  tool_dict: dict[str, Callable[..., Any]]) -> Any:
        bounded = {name: guard_tool(tool, name, self._task_timeout_s, self._faults) for name, tool in tool_dict.items()}
        return await super()._execute_tool_calls(tool_calls, bounded)

    def _push_metrics(self, values: dict[str, Any]) -> None:
        self._faults.drain(self._counters)
        super()._push_metrics(values)

    @property
    def session(self) -> Any:
        return self.__dict__.get("_fleet_session")

    @session.setter
    def session(self, session: Any) -> None:
        """TRL stores the session it opened in `_run_loops` here, before its first request."""
        if session is not None:
            session.headers.update(ProxyClient(self.vllm_server_url, getattr(self, "_run_key", "")).headers)
        self.__dict__["_fleet_session"] = session

    async def _retry(self, coro_factory: Callable[[], Awaitable[Any]], *, label: str, max_attempts: int = 1) -> Any:
        """A completion waits for the fleet up to TRAINER_FLEET_WAIT_S; TRL's inner quick attempts are one try."""
        if label != COMPLETIONS_LABEL:
            return await coro_factory()
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                return await coro_factory()
            except Exception as exc:
                if not retryable(exc):
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                waited = now - first_failure
                if waited >= self._fleet_wait_s:
                    log.error("rollout gave up: the fleet failed for %.0fs (TRAINER_FLEET_WAIT_S=%g): %s: %s",
                              waited, self._fleet_wait_s, type(exc).__name__, exc)
                    raise
                attempt += 1
                self._counters["rollout/vllm_retry_total"] += 1
                sleep = min(2.0 ** (attempt - 1), RETRY_MAX_S, self._fleet_wait_s - waited)
                log.warning("rollout waiting for the fleet: %s: %s; %.0fs of TRAINER_FLEET_WAIT_S=%g, retry in %.1fs",
                            type(exc).__name__, exc, waited, self._fleet_wait_s, sleep)
                await asyncio.sleep(sleep)


class _GuardedFactory:
    """An environment factory whose instances are guarded (guard_environment)."""

    def __init__(self, factory: Callable[[], Any], timeout_s: float, faults: FaultLog) -> None:
        self.factory, self.timeout_s, self.faults = factory, timeout_s, faults

    def __call__(self) -> Any:
        return guard_environment(self.factory(), self.timeout_s, self.faults)


def _uses(function: Any, text: str) -> bool:
    try:
        return text in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def check_rollout_hooks() -> None:
    """Raise ConfigError unless TRL's rollout worker has what FleetRolloutLoop relies on (TRL 1.16's names)."""
    loop_cls = getattr(trl_worker, "_AsyncRolloutLoop", None)
    worker_cls = getattr(trl_worker, "AsyncRolloutWorker", None)
    hooks = {
        "_AsyncRolloutLoop": loop_cls is not None and loop_cls is _TRL_LOOP,
        "RolloutSample": _TRL_SAMPLE is not object,
        "AsyncRolloutWorker._loop_cls": loop_cls is not None and getattr(worker_cls, "_loop_cls", None) is loop_cls,
        "_AsyncRolloutLoop._run_loops storing self.session": _uses(getattr(loop_cls, "_run_loops", None),
                                                                   "self.session"),
        "_AsyncRolloutLoop._post posting on self.session": _uses(getattr(loop_cls, "_post", None), "self.session"),
        f"completions retried as {COMPLETIONS_LABEL!r}": _uses(loop_cls, f'label="{COMPLETIONS_LABEL}"'),
        f"completions posted through self._post({COMPLETIONS_PATH!r})": _uses(
            getattr(loop_cls, "_generate_one_turn", None), f'self._post("{COMPLETIONS_PATH}"'),
        "_score_group building one RolloutSample per training row": _uses(
            getattr(loop_cls, "_score_group", None), "for seq in sequences"),
    }
    missing = [name for name, present in hooks.items() if not present]
    if missing:
        raise ConfigError(
            f"TRAINER_RUN_KEY_FILE / TRAINER_FLEET_WAIT_S: this TRL's rollout worker lacks {', '.join(missing)} "
            "(lorafleet wires into TRL 1.16's): its rollouts could not send the run key, wait for the fleet or say "
            "which replica answered them"
        )


def wire_rollouts(trainer: Any, run_key: str, settings: TrainerSettings) -> None:
    """Make the rollout child that `trainer` spawns at train begin send `run_key` ("" = none), wait up to
    TRAINER_FLEET_WAIT_S for the fleet, guard the task's code and pin episodes as `settings` say. Call it after the
    trainer is built and before `trainer.train()` (TRL starts the worker in on_train_begin)."""
    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        if trainer.accelerator.is_main_process:  # TRL builds the worker on rank 0 only
            raise RolloutsUnsupported("rank 0 has no rollout worker to wire to the fleet")
        return
    if not isinstance(worker, trl_worker.AsyncRolloutWorker) or worker._loop_cls is not trl_worker._AsyncRolloutLoop:
        raise RolloutsUnsupported(
            f"the rollout worker ({type(worker).__name__}, loop {getattr(worker, '_loop_cls', None)!r}) is not TRL's "
            "AsyncRolloutWorker with its own loop: lorafleet cannot give its rollouts the run key and the fleet wait"
        )
    if not isinstance(getattr(worker, "_loop_kwargs", None), dict):
        raise RolloutsUnsupported("TRL's rollout worker has no _loop_kwargs: the settings cannot reach its child")
    if getattr(worker, "_process", None) is not None:
        raise RolloutsUnsupported("the rollout worker was started before it was wired to the fleet")
    trl_seam.set_loop_class(worker, FleetRolloutLoop)
    trl_seam.set_loop_kwargs(worker, **{
        RUN_KEY_KWARG: run_key, FLEET_WAIT_KWARG: settings.trainer_fleet_wait_s,
        TASK_TIMEOUT_KWARG: settings.task_timeout_s, PIN_EPISODES_KWARG: settings.trainer_pin_episodes,
        MAX_STALENESS_KWARG: settings.max_staleness,
    })
