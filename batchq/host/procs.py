"""The host's child processes: each started in its own process group (spawned, or forked
from a warm process), whole groups stopped.

Every child batchq starts (the embedded redis-server, the demo's producers, the workers
of ``serve --workers``, the processes of the tests) runs in its own process group, so
that stopping it also stops whatever it started, and on Linux it gets
``PR_SET_PDEATHSIG=SIGTERM``, so that it dies with its parent even when the parent is
killed with SIGKILL.

What ``/proc`` says of them (Linux; unknown elsewhere): a group's live members, a
process's CPU seconds, the host's idle CPU (the autoscaler's figures). Zombies count as
gone: in some containers PID 1 never reaps orphans, so a dead
grandchild may linger as a zombie that ``kill(pid, 0)`` still reports.

**Forked workers** (``batchq serve --workers`` without an interpreter start per worker):
the pool's process imports the factory and builds what every worker shares (the stream,
its probe batch, the shard plan) once, then :func:`fork_child` starts each worker as a
copy of it. A fork copies only the calling thread, so one taken while another thread
runs may copy a lock that thread held, forever held in the child: :func:`fork_refused`
says why a fork is not safe now (no ``os.fork`` on this platform, or any other Python
thread alive), and the caller falls back to starting a fresh interpreter
(:func:`spawn`). The pool's loop runs no thread, so it forks from its own main thread
right when it decides to add a worker: no fork server is needed.

Before each fork the parent's objects go to the cyclic collector's permanent generation
(``gc.freeze``): a child's collections never visit what it shares with the parent, so
they neither spend a full collection's time on the factory's imports nor write to, and
so copy, those pages. In the forked child, before the worker's function runs: its own
process group (``setpgid``; the parent sets it too, so that neither order races a stop
of the group),
death with the parent (``PR_SET_PDEATHSIG``, as :func:`spawn`'s children), the default
SIGINT/SIGTERM handlers (the parent's forwarders set an event only the parent reads; the
worker installs its own), and fresh random states: Python's ``random``, numpy's and
torch's global generators (where imported) are seeded from ``os.urandom``, so no two
workers draw the same numbers. Redis connections are the caller's business: the pool
drops its client's connections before it forks (:mod:`batchq.cli.serve`), and a worker
makes its own clients. The child ends with ``os._exit``: it never returns into the
parent's stack (whose ``finally`` blocks would stop the other workers).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Protocol, TypeAlias

__all__ = [
    "Child",
    "ForkedChild",
    "StdSpec",
    "cpu_seconds",
    "die_with_parent_preexec",
    "fork_child",
    "fork_refused",
    "group_alive",
    "host_idle",
    "reseed_globals",
    "spawn",
    "stop_group",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

#: What Popen accepts for stdout/stderr: None, PIPE, DEVNULL, STDOUT, an fd or a file.
StdSpec: TypeAlias = int | IO[Any] | None


class Child(Protocol):
    """A child process as :class:`subprocess.Popen` shows it (a spawned one), or
    :class:`ForkedChild` (a forked one)."""

    @property
    def pid(self) -> int:
        """The child's pid (the id of its process group)."""

    @property
    def returncode(self) -> int | None:
        """Its exit code once reaped (negative: killed by that signal), else None."""

    def poll(self) -> int | None:
        """Reap it if it exited: its exit code, else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for its exit; raise :class:`subprocess.TimeoutExpired` after ``timeout``."""


def die_with_parent_preexec() -> Callable[[], None] | None:
    """Build a ``preexec_fn`` that makes the child die (SIGTERM) when its parent dies.

    libc is loaded here, in the parent, so that the child only calls ``prctl`` between
    fork and exec. The death signal fires when the *thread* that forked the child exits,
    so start long-lived children from a long-lived thread (e.g. the main thread).

    Returns:
        The function for ``subprocess.Popen(preexec_fn=...)``, or None where
        ``PR_SET_PDEATHSIG`` does not exist (anything but Linux) or libc cannot be loaded.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # The parent may have died between fork and prctl: then no signal would come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: StdSpec = None,
    stderr: StdSpec = None,
) -> subprocess.Popen[bytes]:
    """Start a child in its own process group that dies with its parent (Linux).

    The child is a session and process-group leader, so its pgid is its pid and
    :func:`stop_group` reaches everything it starts.

    Args:
        argv: the program and its arguments.
        env: the child's whole environment; None inherits ``os.environ``.
        cwd: the child's working directory; None keeps ours.
        stdout: as for :class:`subprocess.Popen` (None inherits ours).
        stderr: as for :class:`subprocess.Popen` (None inherits ours).

    Returns:
        The started process.
    """
    proc = subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=die_with_parent_preexec(),
    )
    log.debug("spawned pid %d: %s", proc.pid, " ".join(argv))
    return proc


def _killpg(pgid: int, sig: int) -> None:
    """Send ``sig`` to the group ``pgid``; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold
    spaces): state, ppid, pgrp, ...; None where it cannot be read (exited, not ours,
    no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _live_members(pgid: int) -> bool | None:
    """Whether a non-zombie process of group ``pgid`` exists (None: no /proc to read)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields and len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def group_alive(pgid: int) -> bool:
    """Tell whether the process group ``pgid`` still has a live (non-zombie) member.

    Args:
        pgid: the process group id (for :func:`spawn`'s children: their pid).

    Returns:
        True while some member runs (or exists and is not ours to signal).
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    live = _live_members(pgid)
    return True if live is None else live


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
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_group(pgid: int, deadline: float) -> bool:
    """Wait until the group is gone or ``deadline`` passes; return whether it is gone."""
    delay = 0.001
    while group_alive(pgid):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)
    return True


def stop_group(proc: Child, *, timeout_s: float = 5.0, sig: int = signal.SIGTERM) -> int | None:
    """Stop a process started by :func:`spawn` and every process of its group.

    Sends ``sig`` to the group, waits up to ``timeout_s`` for the leader and the rest of
    the group to exit, then sends SIGKILL to the group. Processes that are already dead
    (or reaped) are fine.

    Args:
        proc: the group leader (its pid is the group's id).
        timeout_s: how long to wait after ``sig`` before SIGKILL.
        sig: the first signal to send.

    Returns:
        The leader's exit code (negative: killed by that signal), or None if it could
        not be reaped (it is not our child).
    """
    pgid = proc.pid
    deadline = time.monotonic() + max(timeout_s, 0.0)
    _killpg(pgid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    if proc.returncode is None or not _wait_group(pgid, deadline):
        log.warning("process group %d ignored signal %d for %g s: SIGKILL", pgid, sig, timeout_s)
        _killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        _wait_group(pgid, time.monotonic() + 5.0)
    return proc.returncode


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
    # The parent's objects (the factory's imports: millions) to the collector's permanent
    # generation: the child's collections never visit them, so they neither take a full
    # collection's time over them nor write to, and so copy, the pages the child shares
    # with the parent (what gc.freeze is for). A collection first, so that the cycles
    # that are garbage by now (an autoscaling pool's ticks make a few KB between forks)
    # are not kept for ever: it visits only what came since the last freeze (the pool
    # froze the factory's objects once, when it made them), milliseconds.
    gc.collect()
    gc.freeze()
    # SIGINT/SIGTERM held back across the fork: one that reached the child before its
    # handlers were reset ran the parent's (which set a flag only the parent reads) and
    # was lost; held, it is delivered once the defaults are back, and stops the child.
    stops = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid == 0:  # pragma: no cover - the child's lines run in the child (tests cover them)
        code = 1
        try:
            os.setpgid(0, 0)
            if die_with_parent is not None:
                die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            reseed_globals()
            code = target()
        except BaseException:
            log.exception("worker %d failed", os.getpid())
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # The child may not have run yet: a stop of its group must reach it already.
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    log.debug("forked worker %d", pid)
    return ForkedChild(pid)
