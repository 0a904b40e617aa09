"""This host's producer workers, sized by :func:`batchq.host.autoscale.decide` once a second.

:class:`WorkerPool` starts workers through a callable (``batchq serve`` builds one that
forks its warm process, :mod:`batchq.host.forked`, or runs ``python -m batchq.cli serve``,
:func:`batchq.host.procs.spawn`; either in its own process group),
retires them with SIGTERM (:func:`batchq.host.procs.stop_group`: a stopped producer hands its
leases back), and on every tick:

1. reaps workers that exited; one killed by a signal is replaced at once (bounded:
   :class:`batchq.host.keeper.Replacements`); once one exits on its own (the run
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

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from batchq.errors import ConnectionLost
from batchq.host.autoscale import Decision, Figures, ScalePolicy, ScaleState, decide
from batchq.host.keeper import Replacements
from batchq.host.procs import Child, stop_group
from batchq.monitoring.rows import queue_status
from batchq.monitoring.verdict import near_cap
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import autoscale_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import SCALELOG_CAP, default_id, id_pid, time_ms

__all__ = ["SCALELOG_CAP", "WorkerPool", "cpu_seconds", "host_idle"]

log = logging.getLogger(__name__)

#: Decisions kept on the queue's scalelog list.
#: A worker that has not joined this long after its start no longer counts as pending.
JOIN_GRACE_S = 30.0


def host_idle() -> tuple[float, float] | None:
    """(idle, total) CPU jiffies of the host since boot from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat", "rb") as fh:
            fields = fh.readline().split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    return float(values[3] + (values[4] if len(values) > 4 else 0)), float(sum(values[:8]))


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` used; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
            (:mod:`batchq.host.keeper`; default :class:`Replacements`).
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

    def run(self, stopping: threading.Event) -> int:
        """Tick until ``stopping`` is set or every worker exited; stop the rest; exit code."""
        try:
            while not stopping.is_set():
                self.tick(time.monotonic())
                if self.ended and not self.workers:
                    break
                stopping.wait(self.tick_s)
        finally:
            for proc in self.workers:
                code = stop_group(proc, timeout_s=self.stop_timeout_s)
                if code is not None:
                    self.codes.append(code)
            self.workers = []
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
        now_s = time.monotonic()
        for proc in list(self.workers):
            code = proc.poll()
            if code is None:
                continue
            self.workers.remove(proc)
            self.started_at.pop(proc.pid, None)
            if not self.ended and self.replacements.replace(proc, now_s):
                fresh = self._start()  # killed, not finished: the pool keeps its size
                self.workers.append(fresh)
                self.started_at[fresh.pid] = now_s
                continue
            self.codes.append(code)
            self.ended = True
            log.info("worker %d exited with %d: starting no more", proc.pid, code)

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
