"""A pool that keeps its workers: one killed by a signal is replaced, within bounds.

A worker that exits by itself (code 0: the trainer finished the run; another code but
:data:`REPLACE_EXIT_CODE`: its pipeline failed) ends the pool as before: no worker is
started after it, and the pool ends when the last one has exited. A worker that dies by
a signal (SIGKILL from the OOM killer or an operator, SIGSEGV in a native library) while
none has exited by itself is replaced at once, and so is one that stopped itself on a
stuck build (:data:`REPLACE_EXIT_CODE`); its leases come back to the work list when its
heartbeat lapses, as for any dead producer. :class:`Replacements` bounds that: after
``max_deaths`` deaths within ``window_s`` seconds the pool stops replacing (logged as an
error) and the dead worker counts as one that exited. :func:`keep_workers` is the loop
of a fixed pool (``--workers N``); :class:`batchq.host.pool.WorkerPool` (``--workers
auto``) replaces its workers the same way.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from batchq.host.procs import Child, stop_group

__all__ = ["REPLACE_EXIT_CODE", "Replacements", "keep_workers"]

#: The exit code of a worker that stopped itself to be replaced: its build passed
#: ``--build-timeout-s`` and the stuck read cannot be interrupted (EX_TEMPFAIL). The pool
#: replaces it as one killed by a signal, within the same bounds.
REPLACE_EXIT_CODE = 75

log = logging.getLogger(__name__)


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
    stopping: threading.Event,
    *,
    replacements: Replacements | None = None,
    poll_s: float = 0.1,
    stop_timeout_s: float = 10.0,
) -> int:
    """Run ``count`` workers until they exit by themselves or ``stopping`` is set.

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
            for worker in list(workers):
                code = worker.poll()
                if code is None:
                    continue
                workers.remove(worker)
                if not ended and policy.replace(worker, time.monotonic()):
                    workers.append(start())
                    continue
                ended = True
                codes.append(code)
                log.info("worker %d exited with %d: starting no more", worker.pid, code)
            stopping.wait(poll_s)
    finally:
        for worker in workers:
            code = stop_group(worker, timeout_s=stop_timeout_s)
            if code is not None:
                codes.append(code)
    log.info("workers exited with %s", codes)
    return max((abs(c) for c in codes), default=0)
