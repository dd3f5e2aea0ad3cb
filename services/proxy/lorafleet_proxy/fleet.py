"""A replica's whole life in the fleet, and the supervised loops that watch it.

    discovered -> joining --/health 200--> syncing: warm-up, then catch-up --> ready --misbehaves--> ejected
                                              ^                                 |                      |
                                              +---- adapters/pause differ -----+   answers again ------+

- joining: discovered (static list or DNS) until its /health answers 200.
- syncing, first the warm-up (`warm_up`): one greedy token of the base model. /health answers 200 as soon as
  vLLM's API server is up, which is not the same as generating: an engine can fail at its first request (vLLM's
  CPU sampler compiles through torch inductor and needs a C++ compiler), and on CPU the first requests compile
  for tens of seconds. A replica that cannot generate stays out of traffic with its own error in `last_error`
  and `generates: false` in GET /fleet; the warm-up also pays the first-request compile before any rollout or
  probe waits on it. It has its own bound (WARM_UP_TIMEOUT_S), apart from the loads' deadline.
- syncing, then the catch-up (sync.py): it loads the ledger's adapters, matches the fleet's pause state and marks
  the replica ready, within PROXY_LORA_LOAD_TIMEOUT_S. A failed warm-up or catch-up is retried by the health
  loop after a backoff that doubles up to PROXY_SYNC_BACKOFF_MAX_S.
- syncing ends with the canary (canary.py): the replica answers one probe per subject that has an agreed answer
  (the base model, the ledger's adapters), and is ready only if it agrees.
- ready: only ready replicas get traffic and take part in broadcasts. Every health round reconciles it: a replica
  whose adapters or pause state stop matching the ledger (it restarted) goes back to syncing. Readiness is kept,
  not granted once:
  - the agreement canary (every PROXY_CANARY_INTERVAL_S, and at every load) sends a replica whose answer departs
    from the others' back to syncing (`quarantine`): the doubted adapter unloaded and reloaded, the prefix cache
    reset, then probed again; `canary_failure` says why in GET /fleet until it agrees;
  - the circuit breaker ejects a replica whose routed generations fail (5xx, reset, timeout)
    PROXY_BREAKER_FAILURES times in a row or beyond PROXY_BREAKER_FAILURE_RATE of the last
    PROXY_BREAKER_WINDOW; it comes back through the warm-up, i.e. once it generates again.
- ejected, when it misbehaves; it re-syncs once it answers again:
  - connection refused or reset (it died): at once;
  - /health timing out (busy, or hung): only once timeouts have lasted PROXY_EJECT_SLOW_AFTER_S;
  - a bad status or a malformed answer: after PROXY_EJECT_AFTER such checks in a row.
  Ejection and re-sync drop the replica's routing ownership: its cache is gone.
- removed: no longer discovered; its pool closes once its requests are done.

The health loop is supervised: each replica's check is isolated (a malformed answer fails that
replica's check with `last_error` set), and anything unexpected is logged and counted
(`lorafleet_proxy_loop_errors_total`) while the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import httpx
from lorafleet.ledger_file import Entry, LedgerState, fingerprint
from lorafleet.runs import run_of
from lorafleet.settings import Settings
from lorafleet.vllm_api import VLLMClient, VLLMError, VLLMUnreachable, metric_total

from .canary import BASE_SUBJECT, Canary, Key
from .discovery import resolve
from .ledger import Ledger, LedgerWriteError
from .metrics import Metrics
from .replica import Replica, State, upstream_pool
from .router import Router
from .sync import catch_up, mismatch

log = logging.getLogger("lorafleet.proxy.fleet")

__all__ = ["Fleet", "Replica", "State"]

Failure = Literal["refused", "timeout", "status", "malformed"]

WARM_UP_PROMPT = "Hello"
# The warm-up's own bound, apart from PROXY_LORA_LOAD_TIMEOUT_S (a deadline for adapter loads): vLLM's first request
# on CPU compiles for tens of seconds, minutes on a busy 2-core box. A hung replica is ejected by the health loop,
# which cancels its sync, long before this.
WARM_UP_TIMEOUT_S = 600.0


class CanaryDisagreement(VLLMError):
    """A syncing replica's canary answer departs from the fleet's agreed answer: it stays out of routing."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, "CanaryDisagreement")
        self.args = (message,)  # read as what it says, not as an HTTP status


class CannotGenerate(VLLMError):
    """The replica answers /health but failed the one-token warm-up completion; keeps the replica's own error."""

    def __init__(self, cause: VLLMError) -> None:
        super().__init__(cause.status, f"cannot generate: {cause.message}", cause.error_type, cause.body)


async def warm_up(replica: Replica, deadline: float) -> None:
    """One greedy token of the base model before `deadline`; raises CannotGenerate when it fails.

    A paused replica queues new requests until it is resumed, so it is not asked: it was admitted (and so
    generated) before the pause, and the catch-up applies the fleet's pause state next.
    """
    if await replica.client.is_paused():
        log.info("warm-up skipped url=%s: the replica is paused", replica.url)
        return
    base = next(card.id for card in await replica.client.models() if card.parent is None)
    started = time.monotonic()
    try:
        await replica.client.completions({"model": base, "prompt": WARM_UP_PROMPT, "max_tokens": 1,
                                          "temperature": 0.0}, timeout=max(deadline - started, 1.0))
    except VLLMUnreachable:
        raise  # no answer at all: the health loop's business, not a verdict on generation
    except VLLMError as exc:
        replica.generates = False
        raise CannotGenerate(exc) from exc
    replica.generates = True
    log.info("warm-up done url=%s model=%s seconds=%.2f", replica.url, base, time.monotonic() - started)


class Fleet:
    """The replicas, their states and the background loops that keep them in line with the ledger."""

    def __init__(self, settings: Settings, router: Router, ledger: Ledger,
                 transport: httpx.AsyncBaseTransport | None = None, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.router = router
        self.ledger = ledger
        self.metrics = metrics or Metrics()
        self.transport = transport  # None = the network; tests pass an in-process transport
        self.replicas: dict[str, Replica] = {}
        self.lock = asyncio.Lock()  # held by broadcasts and by a sync's final check: one consistent ledger view
        self.broadcast_epoch = 0  # bumped when a broadcast starts and ends: a snapshot read meanwhile is stale
        self.heartbeat = 0.0  # monotonic time of the last completed health round
        self._retired: list[Replica] = []  # removed replicas whose pools close once their requests are done
        self._cancelled: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._block_sizes: set[int] = set()
        self.canary = Canary(settings, self.metrics)
        # Told (url, why) when a replica is ejected: the front gives up its requests in flight (Upstreams.abandon).
        self.on_eject: list[Callable[[str, str], None]] = []

    @contextlib.asynccontextmanager
    async def broadcasting(self) -> AsyncIterator[None]:
        """Hold the lock for a fleet-wide change; the broadcast epoch moves on at both ends."""
        async with self.lock:
            self.broadcast_epoch += 1
            try:
                yield
            finally:
                self.broadcast_epoch += 1

    def commit(self, state: LedgerState) -> LedgerWriteError | None:
        """Persist `state` as the ledger; the error (counted) when it could not be written."""
        try:
            self.ledger.commit(state)
        except LedgerWriteError as exc:
            self.metrics.ledger_write_failures.inc()
            return exc
        return None

    # --- membership ------------------------------------------------------------------------------
    def ready(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.state is State.READY]

    def set_members(self, urls: list[str]) -> None:
        for url in urls:
            if url not in self.replicas:
                http = upstream_pool(self.transport)
                token = self.settings.proxy_upstream_token
                self.replicas[url] = Replica(url, http, VLLMClient(url, token=token, client=http))
                log.info("replica discovered url=%s", url)
        for url in [url for url in self.replicas if url not in urls]:
            replica = self.replicas.pop(url)
            self._cancel_sync(replica)
            replica.state = State.EJECTED
            self.router.forget_replica(url)
            self._retired.append(replica)
            for per_replica in (self.metrics.inflight, self.metrics.replica_adapters):
                with contextlib.suppress(KeyError):
                    per_replica.remove(url)
            self.metrics.forget_answers(replica=url)
            log.warning("replica removed url=%s (no longer discovered) state=%s", url, replica.state)

    def loops_alive(self) -> bool:
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    async def start(self) -> None:
        if self.settings.proxy_upstream_dns:
            await self._discover()
            self._tasks.append(asyncio.create_task(
                self._supervised("dns", self._discover, self.settings.proxy_dns_interval_s), name="proxy-dns"))
        else:
            self.set_members(self.settings.upstream_urls)
        self._tasks.append(asyncio.create_task(
            self._supervised("health", self.health_round, self.settings.proxy_health_interval_s),
            name="proxy-health"))

    def supervise(self, loop: str, body: Callable[[], Awaitable[None]], interval_s: float) -> None:
        """One more supervised loop for the life of the proxy (runs' leases); counted by `loops_alive`."""
        self._tasks.append(asyncio.create_task(self._supervised(loop, body, interval_s), name=f"proxy-{loop}"))

    async def stop(self) -> None:
        for replica in self.replicas.values():
            self._cancel_sync(replica)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._cancelled, return_exceptions=True)
        for replica in [*self.replicas.values(), *self._retired]:
            await replica.http.aclose()
        self._retired.clear()

    async def _supervised(self, loop: str, body: Callable[[], Awaitable[None]], interval_s: float) -> None:
        """Run `body` every `interval_s` for the life of the proxy: an exception is logged, counted, survived."""
        while True:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any bug or odd answer
                self.metrics.loop_errors.labels(loop).inc()
                log.exception("%s loop: unexpected error (the loop goes on)", loop)
            await asyncio.sleep(interval_s)

    async def _discover(self) -> None:
        try:
            self.set_members(await resolve(self.settings.proxy_upstream_dns))
        except OSError as exc:
            log.warning("dns: cannot resolve %s: %s (keeping %d replica(s))", self.settings.proxy_upstream_dns,
                        exc, len(self.replicas))

    # --- health ----------------------------------------------------------------------------------
    async def health_round(self) -> None:
        """Check every replica (isolated from each other), rebuild an unreadable ledger, close retired pools."""
        replicas = list(self.replicas.values())
        healthy = await asyncio.gather(*(self.check(replica) for replica in replicas))
        if self.ledger.rebuilding:
            await self._rebuild_ledger([replica for replica, ok in zip(replicas, healthy, strict=True) if ok])
        for replica in [r for r in self._retired if r.inflight == 0]:
            self._retired.remove(replica)
            await replica.http.aclose()
        self.heartbeat = time.monotonic()

    async def check(self, replica: Replica) -> bool:
        """One health check, isolated: True when the replica answered. Never raises (but for cancellation)."""
        limit = 2 * self.settings.proxy_health_timeout_s
        try:
            async with asyncio.timeout(limit):  # one stuck replica must not stall the round for the others
                failure = await self._probe(replica)
                if failure is not None:
                    self.note_failure(replica, failure[1], failure[0])
                    return False
                replica.slow_since = None
                if replica.state is State.READY:
                    await self._reconcile(replica)
                elif self._sync_due(replica):
                    self._start_sync(replica)
            replica.failures = 0  # only a whole check that passed clears the count
            return True
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.note_failure(replica, f"health check: no complete answer within {limit:.1f}s", "timeout")
            return False
        except VLLMError as exc:
            self.note_failure(replica, f"health check: {exc}", _kind(exc))
            return False
        except Exception as exc:  # a malformed answer fails this replica's check only
            self.note_failure(replica, f"malformed reply: {type(exc).__name__}: {exc}", "malformed")
            return False

    async def _probe(self, replica: Replica) -> tuple[Failure, str] | None:
        try:
            await replica.client.request("GET", "/health", timeout=self.settings.proxy_health_timeout_s)
        except VLLMError as exc:
            return _kind(exc), f"health check: {exc}"
        return None

    def note_failure(self, replica: Replica, error: str, kind: Failure = "status") -> None:
        """A failed health check or routed call. Refused/reset ejects at once; timeouts only after
        PROXY_EJECT_SLOW_AFTER_S of them; other failures after PROXY_EJECT_AFTER in a row."""
        self.metrics.check_failures.labels(kind).inc()
        replica.last_error = error
        if kind == "refused":
            self.eject(replica, error)
        elif kind == "timeout":
            now = time.monotonic()
            replica.slow_since = replica.slow_since or now
            if now - replica.slow_since >= self.settings.proxy_eject_slow_after_s:
                self.eject(replica, f"{error} (timing out for {now - replica.slow_since:.0f}s)")
        else:
            replica.failures += 1
            if replica.failures >= self.settings.proxy_eject_after:
                self.eject(replica, error)

    def eject(self, replica: Replica, error: str) -> None:
        """Out of traffic and broadcasts now; when it answers health checks again it re-syncs to the ledger."""
        if replica.state not in (State.SYNCING, State.READY):
            return
        self._cancel_sync(replica)
        replica.state = State.EJECTED
        replica.last_error = error
        replica.adapters = {}
        replica.engine_queue = 0
        replica.next_sync_at = 0.0
        self.router.forget_replica(replica.url)
        self.metrics.ejections.inc()
        log.warning("replica ejected url=%s failures=%d error=%s", replica.url, replica.failures, error)
        for observer in self.on_eject:
            observer(replica.url, f"ejected: {error}")

    def resync(self, replica: Replica, reason: str) -> None:
        """Take a replica out of traffic and bring it back in line with the ledger."""
        if replica.state is State.EJECTED:
            return
        log.warning("replica resync url=%s reason=%s", replica.url, reason)
        replica.last_error = reason
        replica.state = State.SYNCING
        replica.adapters = {}
        self.router.forget_replica(replica.url)
        self._cancel_sync(replica)
        self._start_sync(replica)

    def quarantine(self, replica: Replica, subject: str, reason: str) -> None:
        """The canary doubts `replica`'s weights for `subject`: out of routing now, re-synced with that adapter
        reloaded and its prefix cache reset, and probed again before it is ready."""
        if replica.state is not State.READY and replica.state is not State.SYNCING:
            return
        self.metrics.canary_disagreements.inc()
        replica.suspect.add(subject)
        replica.canary_failure = reason
        log.error("replica quarantined by the canary url=%s subject=%s: %s", replica.url, subject or "base", reason)
        self.resync(replica, f"canary: {reason}")

    def generation_done(self, replica: Replica, failed: bool, reason: str = "") -> None:
        """The breaker's count of one routed generation; trips (ejects) a replica whose generations keep failing."""
        window = self.settings.proxy_breaker_window
        replica.outcomes.append(failed)
        if len(replica.outcomes) > window:
            replica.outcomes.popleft()
        replica.failing = replica.failing + 1 if failed else 0
        if not failed or replica.state is not State.READY:
            return
        share = sum(replica.outcomes) / len(replica.outcomes)
        in_a_row = replica.failing >= self.settings.proxy_breaker_failures
        if in_a_row or (len(replica.outcomes) * 2 >= window and share >= self.settings.proxy_breaker_failure_rate):
            why = (f"{replica.failing} generations failed in a row" if in_a_row else
                   f"{share:.0%} of the last {len(replica.outcomes)} generations failed")
            self.metrics.breaker_trips.inc()
            replica.outcomes.clear()
            replica.failing = 0
            replica.sync_failures += 1  # it comes back after a backoff, through the warm-up (it must generate)
            self.eject(replica, f"circuit breaker: {why}; last: {reason}")
            replica.next_sync_at = time.monotonic() + min(
                self.settings.proxy_health_interval_s * 2 ** replica.sync_failures,
                self.settings.proxy_sync_backoff_max_s)

    # --- the agreement canary --------------------------------------------------------------------
    def subject_key(self, subject: str, replica: Replica | None = None) -> Key:
        """What a subject's reference is kept under: an adapter's content (fingerprint, else path), the base
        model's name."""
        if subject == BASE_SUBJECT:
            info = replica.info if replica is not None else next((r.info for r in self.ready() if r.info), None)
            return subject, info.model if info is not None else ""
        entry = self.ledger.get(subject)
        return subject, (entry.fingerprint or entry.path) if entry is not None else ""

    def probe_model(self, subject: str, replica: Replica) -> str:
        if subject != BASE_SUBJECT:
            return subject
        return replica.info.model if replica.info is not None else next(
            (r.info.model for r in self.ready() if r.info is not None), "")

    async def judge(self, subject: str, replicas: list[Replica], key: Key | None = None,
                    ) -> tuple[list[Replica], bool, str]:
        """Probe `replicas` for `subject` and judge their answers: (the odd ones, decided, why); `key` where the
        ledger does not hold the subject yet (a load being answered)."""
        if not replicas:
            return [], True, ""
        model = self.probe_model(subject, replicas[0])
        answers = await self.canary.probe_all(model, {r.url: r.client for r in replicas})
        verdict = self.canary.judge(key or self.subject_key(subject, replicas[0]), answers)
        return [r for r in replicas if r.url in verdict.odd], verdict.decided, verdict.why

    async def verify(self, replica: Replica) -> None:
        """The end of a catch-up: the replica answers every subject with an agreed answer as agreed, or stays out
        (raises CanaryDisagreement). Subjects without a reference yet are judged at the next round."""
        subjects = [BASE_SUBJECT, *self.ledger.entries()]
        for subject in subjects:
            key = self.subject_key(subject, replica)
            if key not in self.canary.references:
                continue
            answer = await self.canary.probe(replica.client, self.probe_model(subject, replica))
            if answer is None:
                raise CanaryDisagreement(f"canary: no usable answer for {subject or 'the base model'}")
            if self.canary.agrees_with_reference(key, answer) is False:
                reference = self.canary.references[key]
                raise CanaryDisagreement(
                    f"canary: still departs for {subject or 'the base model'} after a reload and a cache reset "
                    f"(tokens {list(answer.tokens)} vs {list(reference.tokens)}, largest logprob difference "
                    f"{answer.distance(reference):.4g})")
        replica.canary_failure = None
        replica.suspect.clear()

    def canary_subjects(self) -> list[str]:
        """The base model and the newest adapter of each run (the versions rollouts are sampled with now)."""
        newest: dict[str, str] = {}
        for name, entry in self.ledger.entries().items():
            newest[entry.run] = name  # the ledger keeps load order: the last one of a run is its newest
        return [BASE_SUBJECT, *newest.values()]

    async def canary_round(self) -> None:
        """The periodic round: every subject on every ready replica that serves it; odd replicas quarantined."""
        self.canary.rounds += 1
        self.canary.last_round = time.monotonic()
        for subject in self.canary_subjects():
            epoch = self.broadcast_epoch
            holders = [r for r in self.ready() if subject == BASE_SUBJECT or subject in r.adapters]
            odd, decided, why = await self.judge(subject, holders)
            if self.lock.locked() or epoch != self.broadcast_epoch:
                continue  # a broadcast ran meanwhile: these answers may predate it
            if not decided and len(holders) > 1:
                log.warning("canary undecided subject=%s: %s", subject or "base", why)
            for replica in odd:
                self.quarantine(replica, subject, why)

    async def _reconcile(self, replica: Replica) -> None:
        """Compare a ready replica's adapters and pause state with the ledger (a restarted replica lost both)."""
        epoch = self.broadcast_epoch
        listed = await replica.client.loaded_adapters()
        paused = await replica.client.is_paused()
        with contextlib.suppress(VLLMError, ValueError):
            text = await replica.client.metrics()
            replica.engine_queue = int(metric_total(text, "vllm:num_requests_running")
                                       + metric_total(text, "vllm:num_requests_waiting"))
        if self.lock.locked() or epoch != self.broadcast_epoch or replica.state is not State.READY:
            return  # a broadcast ran (or runs) meanwhile: this snapshot may predate it
        replica.observe(listed)
        problem = mismatch(replica, listed, paused, self.ledger.entries(), self.ledger.paused)
        if problem is not None:
            self.resync(replica, f"{problem} (restarted?)")

    # --- syncs -----------------------------------------------------------------------------------
    def _sync_due(self, replica: Replica) -> bool:
        running = replica.sync_task is not None and not replica.sync_task.done()
        return not running and not self.ledger.rebuilding and time.monotonic() >= replica.next_sync_at

    def _start_sync(self, replica: Replica) -> None:
        previous = replica.sync_task if replica.sync_task is not None and not replica.sync_task.done() else None
        replica.sync_task = asyncio.create_task(self._sync_after(previous, replica), name=f"proxy-sync {replica.url}")

    async def _sync_after(self, previous: asyncio.Task[None] | None, replica: Replica) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # a cancelled sync finishes before the next one touches the replica
        await self._admit(replica)

    async def _admit(self, replica: Replica) -> None:
        """syncing: the warm-up, then the catch-up, each within its own bound; ready at the end, or left syncing
        with `last_error` set and the next try after a backoff."""
        replica.state = State.SYNCING
        self.router.forget_replica(replica.url)
        stage, limit = "warm-up", WARM_UP_TIMEOUT_S
        try:
            async with asyncio.timeout(limit):  # its own bound: a first request compiles on CPU, loads do not
                replica.info = await replica.client.server_info()
                self.adopt_block_size(replica)
                await warm_up(replica, time.monotonic() + limit)
            stage, limit = "sync", self.settings.proxy_lora_load_timeout_s
            async with asyncio.timeout(limit):
                started = time.monotonic()
                await catch_up(self, replica, started + limit)
                if replica.state is State.READY:
                    self.metrics.replica_sync_seconds.observe(time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of one replica's sync stays with that replica
            reason = f"{stage} did not finish within {limit:.0f}s" if isinstance(exc, TimeoutError) else f"sync: {exc}"
            if not isinstance(exc, VLLMError | TimeoutError):
                reason = f"sync: malformed reply: {type(exc).__name__}: {exc}"
                self.metrics.loop_errors.labels("sync").inc()
            replica.sync_failures += 1
            backoff = min(self.settings.proxy_health_interval_s * 2 ** replica.sync_failures,
                          self.settings.proxy_sync_backoff_max_s)
            replica.next_sync_at = time.monotonic() + backoff
            replica.last_error = reason
            log.warning("replica sync failed url=%s error=%s (retried in %.1fs)", replica.url, reason, backoff)

    def _cancel_sync(self, replica: Replica) -> None:
        task = replica.sync_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            self._cancelled.add(task)
            task.add_done_callback(self._cancelled.discard)

    def adopt_block_size(self, replica: Replica) -> None:
        size = replica.info.block_size if replica.info else None
        if not size:
            return
        self._block_sizes.add(int(size))
        if len(self._block_sizes) > 1:
            log.warning("replicas report different KV block sizes %s; routing keeps %d",
                        sorted(self._block_sizes), self.router.block_size)
        elif self.settings.proxy_block_size == 0:
            self.router.set_block_size(int(size))

    # --- an unreadable ledger --------------------------------------------------------------------
    async def _rebuild_ledger(self, answering: list[Replica]) -> None:
        """Rebuild the ledger from what the answering replicas hold, instead of unloading the fleet."""
        views: list[tuple[dict[str, str], bool]] = []
        for replica in answering:
            try:
                views.append((await replica.client.loaded_adapters(), await replica.client.is_paused()))
            except Exception as exc:  # one replica's odd answer must not block the rebuild
                self.note_failure(replica, f"ledger rebuild: {type(exc).__name__}: {exc}", "malformed")
        if not views:
            return
        state = LedgerState(paused="keep" if all(paused for _, paused in views) else None)
        for name, path in agreed([listed for listed, _ in views]).items():
            state.adapters[name] = Entry(path, await asyncio.to_thread(fingerprint, path), run_of(name)[0])
        try:
            self.ledger.commit(state)
        except LedgerWriteError as exc:
            log.error("ledger: rebuilt but not written (%s); retrying at the next health round", exc)
            return
        self.metrics.ledger_rebuilds.inc()
        log.error("ledger: REBUILT from %d replica(s) because the file was unusable (%s): adapters=%s paused=%s",
                  len(views), self.ledger.unreadable_reason, list(state.adapters), state.paused)


def _kind(exc: VLLMError) -> Failure:
    """Refused or reset = the replica died; a timeout = it may only be busy; anything else = a bad answer."""
    if not isinstance(exc, VLLMUnreachable):
        return "status"
    return "timeout" if isinstance(exc.__cause__, httpx.TimeoutException) else "refused"


def agreed(views: list[dict[str, str]]) -> dict[str, str]:
    """Adapters (name -> path) some replica holds and no replica binds to another path, in first-seen order.

    A name bound to two paths has no fleet-wide meaning and is left out (the replicas holding it drop it
    during their sync); everything else is kept, so a rebuild never unloads what no client unloaded.
    """
    seen: dict[str, set[str]] = {}
    for listed in views:
        for name, path in listed.items():
            seen.setdefault(name, set()).add(path)
    return {name: next(iter(paths)) for name, paths in seen.items() if len(paths) == 1}
