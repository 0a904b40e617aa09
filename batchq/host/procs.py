"""Process helpers: start children in their own process group, stop whole groups.

Every child batchq starts (the embedded redis-server, the demo's producers, the
processes of the tests) runs in its own process group, so that stopping it also stops
whatever it started, and on Linux it gets ``PR_SET_PDEATHSIG=SIGTERM``, so that it
dies with its parent even when the parent is killed with SIGKILL.

Zombies count as gone: in some containers PID 1 never reaps orphans, so a dead
grandchild may linger as a zombie that ``kill(pid, 0)`` still reports.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Protocol, TypeAlias

__all__ = [
    "Child",
    "StdSpec",
    "die_with_parent_preexec",
    "group_alive",
    "spawn",
    "stop_group",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

#: What Popen accepts for stdout/stderr: None, PIPE, DEVNULL, STDOUT, an fd or a file.
StdSpec: TypeAlias = int | IO[Any] | None


class Child(Protocol):
    """A child process as :class:`subprocess.Popen` shows it (a spawned one), or
    :class:`batchq.host.forked.ForkedChild` (a forked one)."""

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
    logger.debug("spawned pid %d: %s", proc.pid, " ".join(argv))
    return proc


def _killpg(pgid: int, sig: int) -> None:
    """Send ``sig`` to the group ``pgid``; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _live_members(pgid: int) -> bool | None:
    """Whether a non-zombie process of group ``pgid`` exists (None: no /proc to read)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        # Fields after the command name (which may hold spaces): state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
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
        logger.warning("process group %d ignored signal %d for %g s: SIGKILL", pgid, sig, timeout_s)
        _killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        _wait_group(pgid, time.monotonic() + 5.0)
    return proc.returncode
