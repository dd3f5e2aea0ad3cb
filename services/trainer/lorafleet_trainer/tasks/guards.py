"""A task's code may raise, hang or answer garbage: what TRL gets instead, so training never stops for it.

TRL 1.16 lets an exception in a reward function or an environment's `reset`/`get_reward` kill its rollout process
(the trainer then fails), waits for a hung tool or reward for ever, and passes NaN or a list of the wrong length on.
Here every call of the task's code runs in a daemon thread bounded by TASK_TIMEOUT_S. Python cannot stop a thread:
a timed-out call is abandoned (it never calls back into its caller's event loop, async code is cancelled in its own
loop) and at most MAX_HUNG_CALLS of one function's are left running before it is not called again. A failed reward
call scores its group None (TRL leaves None out of the advantage, so a broken reward pushes the policy nowhere), a
failed tool call raises for TRL to answer the model with an error, a crashed environment serves no observation and
no reward. Each fault is counted as
`task/<function>/<kind>_total` in TRL's metrics (metrics.jsonl, Prometheus) and logged with the function's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from trl.trainer.utils import is_async_callable

log = logging.getLogger("lorafleet_trainer.tasks")

FAULT_KINDS = ("error", "timeout", "garbage")


class TaskTimeout(TimeoutError):
    """A call of the task's code outlived TASK_TIMEOUT_S (or too many of its earlier calls still do)."""


# Abandoned calls of one function (by qualified name) still running in their threads; while this many are, the
# function is not called again (the call times out at once) until one returns: hung code costs at most this many
# threads each, however long the run.
MAX_HUNG_CALLS = 8
_hung_lock = threading.Lock()
_hung: dict[str, int] = {}


def hung_calls(name: str) -> int:
    """Abandoned calls of the function `name` whose threads are still running."""
    with _hung_lock:
        return _hung.get(name, 0)


def _count_hung(name: str, change: int) -> None:
    with _hung_lock:
        left = _hung.get(name, 0) + change
        if left:
            _hung[name] = left
        else:
            _hung.pop(name, None)


def _qualname(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class _Call:
    """One call of the task's code in its own daemon thread. The caller may abandon it (a timeout, or the caller's
    own end): from then on the thread delivers nothing (no event loop of the caller is touched, closed or not), async
    code is cancelled in its own loop, and the call counts as hung until its thread ends."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 deliver: Callable[[Any, BaseException | None], None]) -> None:
        self.name = _qualname(fn)
        hung = hung_calls(self.name)
        if hung >= MAX_HUNG_CALLS:
            raise TaskTimeout(f"{self.name} not called: {hung} earlier calls are still running past TASK_TIMEOUT_S "
                              f"(at most {MAX_HUNG_CALLS} are left running; it is called again once one returns)")
        self._lock = threading.Lock()
        self._deliver = deliver
        self._finished = self._abandoned = False
        self._cancel: Callable[[], None] | None = None
        body = (lambda: self._run_async(fn, args, kwargs)) if is_async_callable(fn) else (lambda: fn(*args, **kwargs))
        threading.Thread(target=self._run, args=(body,), daemon=True, name=f"task-{self.name}").start()

    def _run(self, body: Callable[[], Any]) -> None:
        value, error = None, None
        try:
            value = body()
        except BaseException as exc:  # handed to the caller, who decides
            error = exc
        with self._lock:
            self._finished = True
            if not self._abandoned:
                self._deliver(value, error)
                return
        _count_hung(self.name, -1)

    def _run_async(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        async def main() -> Any:
            task, loop = asyncio.current_task(), asyncio.get_running_loop()
            assert task is not None
            self._on_abandon(lambda: loop.call_soon_threadsafe(task.cancel))
            return await fn(*args, **kwargs)

        return asyncio.run(main())

    def _on_abandon(self, cancel: Callable[[], None]) -> None:
        with self._lock:
            if not self._abandoned:
                self._cancel = cancel
                return
        cancel()

    def abandon(self) -> bool:
        """Give the call up; False when it had finished already (its outcome was delivered)."""
        with self._lock:
            if self._finished or self._abandoned:
                return False
            self._abandoned = True
            _count_hung(self.name, 1)  # under the call's lock: the thread's release comes after
            cancel = self._cancel
        if cancel is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: the coroutine ended
                cancel()
        return True


def _late(fn: Callable[..., Any], timeout_s: float) -> TaskTimeout:
    return TaskTimeout(f"{getattr(fn, '__name__', fn)} did not return within TASK_TIMEOUT_S={timeout_s:g}s")


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a daemon thread (an async `fn` run to its end there, in its own loop); TaskTimeout
    when it takes longer than `timeout_s` (the call is abandoned: async code is cancelled)."""
    finished = threading.Event()
    outcome: list[Any] = []
    call = _Call(fn, args, kwargs, lambda value, exc: (outcome.extend((value, exc)), finished.set()))
    if not finished.wait(timeout_s) and call.abandon():
        raise _late(fn, timeout_s)
    value, exc = outcome
    if exc is not None:
        raise exc
    return value


async def await_with_timeout(fn: Callable[..., Any], timeout_s: float, /, **kwargs: Any) -> Any:
    """Await an async `fn`, or run a sync one in a daemon thread, for at most `timeout_s` (then TaskTimeout). A sync
    call the caller stops waiting for (timeout, cancellation) is abandoned: it never calls back into the loop."""
    if is_async_callable(fn):
        awaitable = fn(**kwargs)
        call = None
    else:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            def apply() -> None:
                if not future.done():
                    future.set_exception(exc) if exc is not None else future.set_result(value)

            with contextlib.suppress(RuntimeError):  # the loop closed without cancelling its waiter: nobody waits
                loop.call_soon_threadsafe(apply)

        call = _Call(fn, (), kwargs, settle)
        awaitable = future
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise _late(fn, timeout_s) from None
    finally:
        if call is not None:
            call.abandon()


def clean_score(value: Any) -> float | None:
    """A finite float, or None for what TRL cannot use (None, NaN, inf, text, anything not a number)."""
    if value is None or isinstance(value, str | bytes):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def clean_scores(values: Any, expected: int) -> tuple[list[float | None], str | None]:
    """The scores TRL gets for `expected` completions, and what was wrong with `values` (None when nothing)."""
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        return [None] * expected, f"returned {type(values).__name__}, not a list of {expected} scores"
    if len(values) != expected:
        return [None] * expected, f"returned {len(values)} scores for {expected} completions"
    scores = [clean_score(value) for value in values]
    bad = sum(score is None and value is not None for score, value in zip(scores, values, strict=True))
    return scores, (f"{bad} of {expected} scores are not finite numbers (e.g. {values[scores.index(None)]!r})"
                    if bad else None)


class FaultLog:
    """Counts and logs the task's faults under the function's name (from any thread; `drain` into TRL's metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._totals: dict[str, int] = {}

    def fault(self, name: str, kind: str, detail: str) -> None:
        key = f"task/{name}/{kind}_total"
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1
            self._totals[key] = total = self._totals.get(key, 0) + 1
        log.warning("task fault: %s %s: %s (scored None or answered with an error; %d %s faults in this run)",
                    name, kind, detail, total, kind)

    def drain(self, counters: MutableMapping[str, float]) -> None:
        """Add the faults since the last drain to `counters` (TRL's, on its event loop's thread)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for key, count in pending.items():
            counters[key] = counters.get(key, 0) + count


def guard_reward(func: Callable[..., Any], name: str, timeout_s: float, faults: FaultLog) -> Callable[..., Any]:
    """`func` as TRL calls it (awaited, keyword arguments), never raising, hanging or scoring garbage."""

    async def guarded(**kwargs: Any) -> list[float | None]:
        expected = len(kwargs.get("completions") or kwargs.get("completion_ids") or [])
        try:
            values = await await_with_timeout(func, timeout_s, **kwargs)
        except TaskTimeout as exc:
            faults.fault(name, "timeout", str(exc))
            return [None] * expected
        except Exception as exc:
            faults.fault(name, "error", f"{type(exc).__name__}: {exc}")
            return [None] * expected
        scores, problem = clean_scores(values, expected)
        if problem:
            faults.fault(name, "garbage", problem)
        return scores

    guarded.__name__ = name
    return guarded


def guard_tool(tool: Callable[..., Any], name: str, timeout_s: float, faults: FaultLog) -> Callable[..., Any]:
    """`tool` bounded by `timeout_s`: a hung call raises TaskTimeout, which TRL answers the model with as an error."""

    async def bounded(**arguments: Any) -> Any:
        try:
            return await await_with_timeout(tool, timeout_s, **arguments)
        except TaskTimeout as exc:
            faults.fault(name, "timeout", str(exc))
            raise
        except Exception as exc:
            faults.fault(name, "error", f"{type(exc).__name__}: {exc}")
            raise

    bounded.__name__ = name
    return bounded


def guard_environment(instance: Any, timeout_s: float, faults: FaultLog) -> Any:
    """An environment whose `reset` and `get_reward` never raise or hang: a crashed one serves no observation and
    scores None until its next good `reset`. Instance attributes shadow the class's methods, which TRL lists."""
    kind = type(instance).__name__
    reset, get_reward = instance.reset, getattr(instance, "get_reward", None)
    state = {"crashed": False}

    def guarded_reset(**row: Any) -> Any:
        try:
            observation = call_with_timeout(reset, timeout_s, **row)
        except Exception as exc:
            state["crashed"] = True
            faults.fault(f"{kind}.reset", "timeout" if isinstance(exc, TaskTimeout) else "error",
                         f"{type(exc).__name__}: {exc}; this episode runs on the dataset prompt alone")
            return None
        state["crashed"] = False
        return observation

    def guarded_reward() -> float | None:
        if state["crashed"]:
            return None
        try:
            value = call_with_timeout(get_reward, timeout_s)
        except Exception as exc:
            faults.fault(f"{kind}.get_reward", "timeout" if isinstance(exc, TaskTimeout) else "error",
                         f"{type(exc).__name__}: {exc}")
            return None
        score = clean_score(value)
        if score is None and value is not None:
            faults.fault(f"{kind}.get_reward", "garbage", f"returned {value!r}, not a finite number")
        return score

    try:
        instance.reset = guarded_reset
        if get_reward is not None:
            instance.get_reward = guarded_reward
    except AttributeError:  # __slots__ or read-only: TRL calls it unguarded
        log.warning("task environment %s cannot be guarded (its attributes are read-only): a crash in it stops the "
                    "rollouts", kind)
    return instance
