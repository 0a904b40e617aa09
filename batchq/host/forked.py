"""Workers forked from a warm process: ``batchq serve --workers`` without an interpreter
start per worker.

The pool's process imports the factory and builds what every worker shares (the stream,
its probe batch, the shard plan) once, then :func:`fork_child` starts each worker as a
copy of it. A fork copies only the calling thread, so one taken while another thread
runs may copy a lock that thread held, forever held in the child: :func:`fork_refused`
says why a fork is not safe now (no ``os.fork`` on this platform, or any other Python
thread alive), and the caller falls back to starting a fresh interpreter
(:func:`batchq.host.procs.spawn`). The pool's loop runs no thread, so it forks from its
own main thread right when it decides to add a worker: no fork server is needed.

In the child, before the worker's function runs: its own process group (``setpgid``;
the parent sets it too, so that neither order races a stop of the group), death with
the parent (``PR_SET_PDEATHSIG``, as :func:`batchq.host.procs.spawn`'s children), the
default SIGINT/SIGTERM handlers (the parent's forwarders set an event only the parent
reads; the worker installs its own), and fresh random states: Python's ``random``,
numpy's and torch's global generators (where imported) are seeded from ``os.urandom``,
so no two workers draw the same numbers. Redis connections are the caller's business:
the pool drops its client's connections before it forks (:func:`batchq.cli.serve`),
and a worker makes its own clients. The child ends with ``os._exit``: it never returns
into the parent's stack (whose ``finally`` blocks would stop the other workers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable

from batchq.host.procs import die_with_parent_preexec

__all__ = ["ForkedChild", "fork_child", "fork_refused", "reseed_globals"]

log = logging.getLogger(__name__)


def fork_refused() -> str | None:
    """Why forking a worker from this process is not safe now; None when it is.

    Only Python threads are seen: a native library's thread pool (OpenMP's) is the
    library's to survive a fork, as it is under a DataLoader's forked workers.
    """
    if not hasattr(os, "fork") or not hasattr(os, "setpgid"):
        return f"this platform ({sys.platform}) has no fork"
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        return f"{len(names)} other thread(s) run in this process ({', '.join(names)})"
    return None


def reseed_globals() -> None:
    """Seed Python's, numpy's and torch's global generators from ``os.urandom`` (numpy
    and torch only where already imported: batchq imports neither)."""
    random.seed(os.urandom(16))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


class ForkedChild:
    """A forked worker, as :class:`subprocess.Popen` shows a child: ``pid``,
    ``returncode`` (negative: killed by that signal), :meth:`poll`, :meth:`wait`.

    Args:
        pid: the child's pid (its process group's id too).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code if the child exited (reaped now), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its code unknown
                self.returncode = 0
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child's exit (``timeout`` seconds at most, None: no limit).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``.
        """
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(delay if left is None else min(delay, left))
            delay = min(delay * 2, 0.05)
        return code


def fork_child(target: Callable[[], int]) -> ForkedChild:
    """Fork a worker that runs ``target()`` and exits with its return value.

    An exception in ``target`` is logged and exits 1 (a worker's failed pipeline, as a
    ``batchq serve`` process exits).

    Raises:
        OSError: the fork failed. Check :func:`fork_refused` first: this function forks
            whatever threads run.
    """
    die_with_parent = die_with_parent_preexec()  # built here: it names the parent's pid
    for stream in (sys.stdout, sys.stderr):  # else the child writes our buffer again
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's lines run in the child (tests cover them)
        code = 1
        try:
            os.setpgid(0, 0)
            if die_with_parent is not None:
                die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            reseed_globals()
            code = target()
        except BaseException:
            log.exception("worker %d failed", os.getpid())
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    # The child may not have run yet: a stop of its group must reach it already.
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    log.debug("forked worker %d", pid)
    return ForkedChild(pid)
