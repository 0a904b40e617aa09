"""This host's producer workers (``batchq serve --workers``): kept, and sized by
:func:`batchq.host.autoscale.decide` once a second.

**Kept.** A worker that exits by itself (code 0: the trainer finished the run; another
code but :data:`REPLACE_EXIT_CODE`: its pipeline failed) ends the pool: no worker is
started after it, and the pool ends when the last one has exited. A worker that dies by
a signal (SIGKILL from the OOM killer or an operator, SIGSEGV in a native library) while
none has exited by itself is replaced at once, and so is one that stopped itself on a
stuck build (:data:`REPLACE_EXIT_CODE`); its leases come back to the work list when its
heartbeat lapses, as for any dead producer. :class:`Replacements` bounds that: after
``max_deaths`` deaths within ``window_s`` seconds the pool stops replacing (logged as an
error) and the dead worker counts as one that exited. :func:`keep_workers` is the loop
of a fixed pool (``--workers N``); both pools reap by :func:`reap_workers`.

**Sized** (``--workers auto`` or MIN:MAX).

:class:`WorkerPool` starts workers through a callable (``batchq serve`` builds one that
forks its warm process, :func:`batchq.host.procs.fork_child`, or runs ``python -m
batchq.cli serve``, :func:`batchq.host.procs.spawn`; either in its own process group),
retires them with SIGTERM (:func:`batchq.host.procs.stop_group`: a stopped producer
hands its leases back), and on every tick:

1. reaps workers that exited; one killed by a signal is replaced at once (bounded:
   :class:`Replacements`); once one exits on its own (the run
   finished, or its pipeline failed) the pool starts no more and ends when the last one
   has exited;
2. refreshes its entry in the queue's autoscaler set (``scalers``) and reads the
   queue's status row (:func:`batchq.monitoring.rows.queue_status`);
3. counts its workers that have not joined yet as alive (a worker's default id is
   ``host-pid-random``, so the pool knows its own), and measures the host's idle CPU
   and its workers' CPU (``/proc``; unknown elsewhere);
4. decides, and carries out a change only under the queue's decision lease (``scale``:
   SET NX PX), which it keeps while workers it started have not joined.

Every change is logged (INFO) with the figures behind it, counted in the queue's stats
hash (``autoscale_add``, ``autoscale_retire``: the exporter's
``batchq_autoscale_decisions_total``) and pushed, as JSON, on the queue's ``scalelog``
list (newest first, capped at :data:`SCALELOG_CAP`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from batchq.client.connection import StopEvent
from batchq.errors import ConnectionLost
from batchq.host.autoscale import Decision, Figures, ScalePolicy, ScaleState, decide
from batchq.host.procs import Child, cpu_seconds, host_idle, stop_group
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import autoscale_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import SCALELOG_CAP, default_id, id_pid, time_ms

__all__ = [
    "REPLACE_EXIT_CODE",
    "SCALELOG_CAP",
    "Reaped",
    "Replacements",
    "WorkerPool",
    "keep_workers",
    "reap_workers",
    "stop_workers",
]

log = logging.getLogger(__name__)

#: The exit code of a worker that stopped itself to be replaced: its build passed
#: ``--build-timeout-s`` and the stuck read cannot be interrupted (EX_TEMPFAIL). The pool
#: replaces it as one killed by a signal, within the same bounds.
REPLACE_EXIT_CODE = 75


class Replacements:
    """Which dead workers a pool replaces: at most ``max_deaths`` within ``window_s``.

    Args:
        max_deaths: deaths by a signal replaced within any ``window_s`` seconds.
        window_s: the span they are counted over.
    """

    def __init__(self, max_deaths: int = 5, window_s: float = 60.0) -> None:
        self.max_deaths, self.window_s = max_deaths, window_s
        self.deaths: collections.deque[float] = collections.deque()
        self.replaced = 0
        self.exhausted = False

    def replace(self, worker: Child, now_s: float) -> bool:
        """Whether the pool replaces ``worker``, which exited (its ``returncode`` set)
        while no worker had exited by itself; logs the death either way."""
        code = worker.returncode
        if code is None or (code >= 0 and code != REPLACE_EXIT_CODE) or self.exhausted:
            return False
        self.deaths.append(now_s)
        while self.deaths and now_s - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.max_deaths:
            self.exhausted = True
            log.error(
                "worker %d %s: %d deaths within %g s, replacing no more",
                worker.pid, _death(code), len(self.deaths), self.window_s,
            )  # fmt: skip
            return False
        self.replaced += 1
        log.warning("worker %d %s: replacing it", worker.pid, _death(code))
        return True


def _death(code: int) -> str:
    """How a replaced worker ended, for the log."""
    if code == REPLACE_EXIT_CODE:
        return "stopped on a stuck build (build_timeout_s)"
    return f"died by signal {-code}"


def keep_workers(
    start: Callable[[], Child],
    count: int,
    stopping: StopEvent,
    *,
    replacements: Replacements | None = None,
    poll_s: float = 0.1,
    stop_timeout_s: float = 10.0,
) -> int:
    """Run ``count`` workers until they exit by themselves or ``stopping`` is set: the
    loop of a fixed pool (``--workers N``).

    Args:
        start: starts one worker (in its own process group).
        count: the workers kept.
        stopping: set (by a signal handler) to stop every worker.
        replacements: which dead workers are replaced (default :class:`Replacements`).
        poll_s: seconds between looks at the workers.
        stop_timeout_s: how long a stopped worker may take to hand its leases back.

    Returns:
        The largest absolute exit code of the workers that exited (0: the run finished).
    """
    policy = replacements or Replacements()
    workers = [start() for _ in range(count)]
    codes: list[int] = []
    ended = False  # a worker exited by itself: start no more
    try:
        while workers and not stopping.is_set():
            ended = reap_workers(workers, start, policy, ended, codes).ended
            stopping.wait(poll_s)
    finally:
        stop_workers(workers, stop_timeout_s, codes)
    log.info("workers exited with %s", codes)
    return max((abs(c) for c in codes), default=0)


class Reaped(NamedTuple):
    """What one look at a pool's workers found (:func:`reap_workers`)."""

    ended: bool  # a worker has exited by itself: the pool starts no more
    exited: list[Child]  # taken out of the pool
    started: list[Child]  # started in the place of workers the policy replaces


def reap_workers(
    workers: list[Child],
    start: Callable[[], Child],
    replacements: Replacements,
    ended: bool,
    codes: list[int],
) -> Reaped:
    """Take the workers that exited out of ``workers`` (both pools' rule): one killed by a
    signal while none had exited by itself is replaced, within ``replacements``' bounds,
    by a fresh one (appended); any other's exit code goes to ``codes``."""
    exited: list[Child] = []
    started: list[Child] = []
    for worker in list(workers):
        code = worker.poll()
        if code is None:
            continue
        workers.remove(worker)
        exited.append(worker)
        if not ended and replacements.replace(worker, time.monotonic()):
            fresh = start()  # killed, not finished: the pool keeps its size
            workers.append(fresh)
            started.append(fresh)
            continue
        ended = True
        codes.append(code)
        log.info("worker %d exited with %d: starting no more", worker.pid, code)
    return Reaped(ended, exited, started)


def stop_workers(workers: list[Child], timeout_s: float, codes: list[int]) -> None:
    """Stop every worker left (SIGTERM, then SIGKILL past ``timeout_s``), their exit
    codes to ``codes``; ``workers`` is emptied."""
    for worker in workers:
        code = stop_group(worker, timeout_s=timeout_s)
        if code is not None:
            codes.append(code)
    workers.clear()


#: A worker that has not joined this long after its start no longer counts as pending.
JOIN_GRACE_S = 30.0


def _idle_cores(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """The host's idle cores between two :func:`host_idle` readings, None if unknown."""
    if after is None or before is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    return max(0.0, share) * (os.cpu_count() or 1)


def _worker_cores(before: dict[int, float], after: dict[int, float], dt: float) -> float | None:
    """The cores one worker used over ``dt`` seconds (the mean of those read both times:
    pid -> :func:`cpu_seconds`), None if none was."""
    deltas = [c - before[pid] for pid, c in after.items() if pid in before]
    return max(0.0, sum(deltas) / len(deltas) / dt) if deltas else None


class WorkerPool:
    """Run and size this host's workers for one queue.

    Args:
        client: a Redis client returning bytes.
        queue: the queue the workers serve.
        policy: the bounds and tunables (a fixed pool when ``policy.auto`` is False).
        start: starts one worker process (in its own process group).
        replacements: which workers that died by a signal are replaced
            (default :class:`Replacements`).
        tick_s: seconds between looks at the queue.
        stop_timeout_s: how long a retired worker may take to hand its leases back.
    """

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        policy: ScalePolicy,
        start: Callable[[], Child],
        *,
        tick_s: float = 1.0,
        stop_timeout_s: float = 10.0,
        replacements: Replacements | None = None,
    ) -> None:
        self.client, self.keys, self.policy, self._start = client, QueueKeys(queue), policy, start
        self.tick_s, self.stop_timeout_s = tick_s, stop_timeout_s
        self.id = default_id()  # a producer's form: the pid tells this host's workers
        self.state = ScaleState()
        self.workers: list[Child] = []
        self.replacements = replacements or Replacements()
        self.started_at: dict[int, float] = {}
        self.codes: list[int] = []
        self.ended = False
        self._cpu: tuple[float, tuple[float, float] | None, dict[int, float]] | None = None
        self._last_hold = ""

    # ------------------------------------------------------------------ the loop

    def run(self, stopping: StopEvent) -> int:
        """Tick until ``stopping`` is set or every worker exited; stop the rest; exit code."""
        try:
            while not stopping.is_set():
                self.tick(time.monotonic())
                if self.ended and not self.workers:
                    break
                stopping.wait(self.tick_s)
        finally:
            stop_workers(self.workers, self.stop_timeout_s, self.codes)
            self._leave()
        log.info("workers exited with %s; decisions %s", self.codes, self.state.counts)
        return max((abs(c) for c in self.codes), default=0)

    def tick(self, now_s: float) -> Decision:
        """One look: reap, read the figures, decide, act (see the module docstring)."""
        self._reap()
        if self.ended:
            return Decision("hold", 0, "a worker exited: the pool only waits for the rest")
        try:
            figures = self._figures(now_s)
            self.state.observe(figures, now_s)
            decision = decide(self.policy, self.state, figures, now_s)
            bounds = not self.policy.min_workers <= figures.local <= self.policy.max_workers
            if decision.action != "hold" and not bounds and not self._take_lease():
                decision = Decision("hold", 0, "another autoscaler is changing its pool")
            self._act(decision, figures, now_s)
            self._keep_lease(now_s)
        except (redis.RedisError, ConnectionLost) as e:
            log.warning("autoscaler: reading the queue failed: %s (holding)", e)
            decision = Decision("hold", 0, f"Redis error: {e}")
            if len(self.workers) < self.policy.min_workers:  # never below the minimum
                self._act(Decision("add", self.policy.min_workers - len(self.workers),
                                   "below the minimum"), None, now_s)  # fmt: skip
        return decision

    # ------------------------------------------------------------------ pieces

    def _reap(self) -> None:
        reaped = reap_workers(self.workers, self._start, self.replacements, self.ended, self.codes)
        self.ended = reaped.ended
        for proc in reaped.exited:
            self.started_at.pop(proc.pid, None)
        now_s = time.monotonic()
        for fresh in reaped.started:
            self.started_at[fresh.pid] = now_s

    def _joined(self, row: dict[str, Any]) -> set[int]:
        pids = {id_pid(str(p["id"])) for p in row["producers"]}
        return {w.pid for w in self.workers} & pids

    def _pending(self, row: dict[str, Any], now_s: float) -> int:
        joined = self._joined(row)
        return sum(
            1
            for w in self.workers
            if w.pid not in joined and now_s - self.started_at.get(w.pid, now_s) < JOIN_GRACE_S
        )

    def _cpu_figures(self, now_s: float) -> tuple[float | None, float | None]:
        """(idle cores of the host, cores one worker uses) since the last call."""
        idle = host_idle()
        used = {w.pid: c for w in self.workers if (c := cpu_seconds(w.pid)) is not None}
        prev, self._cpu = self._cpu, (now_s, idle, used)
        if prev is None or now_s <= prev[0]:
            return None, None
        return _idle_cores(prev[1], idle), _worker_cores(prev[2], used, now_s - prev[0])

    def _figures(self, now_s: float) -> Figures:
        # Imported at the first tick, not with this module: a fixed pool (keep_workers)
        # reads no status row, and batchq.monitoring's import (about 45 ms) would come
        # before its first fork, on the first batch's path (issue 40).
        from batchq.monitoring.rows import queue_status
        from batchq.monitoring.verdict import near_cap

        now_ms = time_ms(self.client.time())
        keys, deadline_ms = self.keys, now_ms + 3_000 + 3_000 * self.tick_s

        def register(pipe: Any) -> None:
            pipe.zadd(keys.scalers, {self.id: deadline_ms})
            pipe.zremrangebyscore(keys.scalers, "-inf", now_ms)
            pipe.zcard(keys.scalers)

        scalers = int(execute_pipeline(self.client, register)[2])
        row = queue_status(self.client, self.keys.queue)
        idle_cores, worker_cores = self._cpu_figures(now_s)
        pending = self._pending(row, now_s)
        return Figures(
            verdict=row["verdict"],
            alive=row["producers_alive"] + pending,
            pending=pending,
            full=near_cap(row["depth"], row["hwm"]),
            local=len(self.workers),
            recommended=row["recommended_producers"],
            scalers=max(1, scalers),
            cause=row["verdict_cause"],
            idle_cores=idle_cores,
            worker_cores=worker_cores,
            demand=row["demand_batches_per_s"],
            per_producer=row["producer_batches_per_s"],
        )

    def _take_lease(self) -> bool:
        lease_ms = int(1000 * max(self.policy.cooldown_s, self.tick_s))
        if self.client.set(self.keys.scale, self.id, nx=True, px=lease_ms):
            return True
        holder = self.client.get(self.keys.scale)
        return _is(holder, self.id)

    def _keep_lease(self, now_s: float) -> None:
        # While workers this pool started have not joined, the others' figures miss them.
        if any(now_s - t < JOIN_GRACE_S for t in self.started_at.values()):
            holder = self.client.get(self.keys.scale)
            if _is(holder, self.id):
                self.client.pexpire(self.keys.scale, int(1000 * self.policy.cooldown_s))

    def _act(self, decision: Decision, figures: Figures | None, now_s: float) -> None:
        if decision.action == "hold":
            if decision.reason != self._last_hold:
                log.debug("autoscaler holds: %s", decision.reason)
                self._last_hold = decision.reason
            return
        if decision.action == "add":
            for _ in range(decision.count):
                proc = self._start()
                self.workers.append(proc)
                self.started_at[proc.pid] = now_s
        else:
            for proc in self.workers[-decision.count :][::-1]:
                self.workers.remove(proc)
                self.started_at.pop(proc.pid, None)
                stop_group(proc, timeout_s=self.stop_timeout_s)
        self.state.record(decision, now_s)
        entry = {
            "t": round(time.time(), 3),
            "scaler": self.id,
            "action": decision.action,
            "count": decision.count,
            "workers": len(self.workers),
            "reason": decision.reason,
            "figures": figures.as_dict() if figures else None,
        }
        log.info(
            "autoscaler %s %d worker(s), now %d: %s; figures %s",
            decision.action, decision.count, len(self.workers), decision.reason,
            json.dumps(entry["figures"]),
        )  # fmt: skip
        keys = self.keys

        def log_it(pipe: Any) -> None:
            pipe.hincrby(keys.stats, autoscale_field(decision.action), decision.count)
            pipe.lpush(keys.scalelog, json.dumps(entry))
            pipe.ltrim(keys.scalelog, 0, SCALELOG_CAP - 1)

        with self._quiet():
            execute_pipeline(self.client, log_it)

    def _quiet(self) -> contextlib.suppress:
        return contextlib.suppress(redis.RedisError, ConnectionLost)

    def _leave(self) -> None:
        with self._quiet():
            self.client.zrem(self.keys.scalers, self.id)
            holder = self.client.get(self.keys.scale)
            if _is(holder, self.id):
                self.client.delete(self.keys.scale)


def _is(holder: bytes | str | None, scaler: str) -> bool:
    """Whether the lease value ``holder`` names ``scaler``."""
    if isinstance(holder, bytes):
        holder = holder.decode()
    return holder == scaler
