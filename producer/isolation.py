"""Isolation: a shard that failed before is built with each example's read tried first
in a forked child, so an example that kills its process (a native crash: SIGSEGV,
SIGABRT) or never returns is found, named and handled like one that raises.

A producer that dies while building a shard cannot say which example killed it, and a
build past ``build_timeout_s`` cannot be interrupted. So a shard whose earlier attempt
failed (raised, timed out, or its producer died: lease.lua's ``attempts``) is built
*isolated*: before the stream reads example i in-process, a :class:`ChildReader` reads
it in a child forked from the producer (one child per isolated stretch of shards: the
indices go down a pipe, one byte comes back per read). The child dying by a signal, or
not answering within ``timeout_s`` (then it is killed), is
:class:`producer.errors.ExampleKilled` naming the example and how, raised where the read
would have raised: with ``on_sample_error='quarantine'`` the example is recorded and
replaced like one that raised (:mod:`producer.quarantine`), else the shard's attempt
fails (handback.lua) and after ``max_attempts`` the trainer gets ``ProducerFailed`` naming
it. The survivor, not the dead process, reports: an outside kill (the OOM killer, an
operator) of a producer only makes the next builder of its shards isolate them, never
condemns an example. What the child read is thrown away; the parent then reads the
example itself, so the batch is the one any producer builds (whether an example kills
is taken as a property of the example, as whether it raises is). Only isolated shards
pay the fork and the second read.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import resource
import select
import signal
import struct
import sys
import warnings
from collections.abc import Callable
from typing import Any

from producer.errors import ExampleKilled
from producer.serving.sharding import find_root

__all__ = ["ChildReader", "isolation_of"]

_OK = b"."
_INDEX = struct.Struct("<q")
_PR_SET_PDEATHSIG = 1


class ChildReader:
    """Tries reads in a child forked on the first one (and again after one killed it).

    Args:
        read: ``read(index)`` (what it returns or raises stays in the child).
    """

    def __init__(self, read: Callable[[int], Any]) -> None:
        self.read = read
        self.pid: int | None = None
        self._to_child = -1
        self._from_child = -1

    def try_read(self, index: int, what: str, timeout_s: float | None) -> None:
        """Return once ``read(index)`` returned or raised in the child.

        Args:
            what: what is read ('example 7'), for the error's message.
            timeout_s: the longest the read may take (None: no limit).

        Raises:
            ExampleKilled: the child died during the read, or did not answer within
                timeout_s (then it was killed); the next read forks a new child.
        """
        if self.pid is None or not self._send(index):
            self.close()  # a child gone between reads (killed from outside): another
            self._fork()
            if not self._send(index):
                raise ExampleKilled(f"the producer died before reading {what}")
        answered = _readable(self._from_child, timeout_s)
        byte = os.read(self._from_child, 1) if answered else b""
        if byte == _OK:
            return
        status = self.close()
        if not answered:
            raise ExampleKilled(
                f"{what} never returned: no result after build_timeout_s={timeout_s} "
                "(read in a forked child, stopped)"
            )
        raise ExampleKilled(f"the producer died ({_how(status)}) building {what}")

    def close(self) -> int:
        """Stop the child (SIGKILL: it waits for an index, or is stuck in a read) and
        reap it; its wait status (0 for none)."""
        pid, self.pid = self.pid, None
        for fd in (self._to_child, self._from_child):
            if fd >= 0:
                os.close(fd)
        self._to_child = self._from_child = -1
        if pid is None:
            return 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # no-op for one that died already
        return os.waitpid(pid, 0)[1]

    def _send(self, index: int) -> bool:
        try:
            os.write(self._to_child, _INDEX.pack(index))
        except BrokenPipeError:
            return False
        return True

    def _fork(self) -> None:
        prctl = _prctl()  # loaded here: no dlopen in a child forked beside other threads
        parent = os.getpid()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        with warnings.catch_warnings():  # fork beside the heartbeat thread: the child reads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover (the child: coverage does not follow it)
            os.close(down_w)
            os.close(up_r)
            _child(self.read, down_r, up_w, prctl, parent)
        os.close(down_r)
        os.close(up_w)
        self.pid, self._to_child, self._from_child = pid, down_w, up_r


def isolation_of(stream: Any) -> Callable[[bool, float | None], bool] | None:
    """``(on, timeout_s) -> isolated``: turns isolation on or off for the shard built
    next, where the root of ``stream`` reads example by example (its ``isolate``, as
    :class:`producer.torch.dataset.DatasetStream`'s; it returns whether the shard is
    built isolated); None where the root has none."""
    isolate = getattr(find_root(stream), "isolate", None)
    return isolate if callable(isolate) else None


def _child(
    read: Callable[[int], Any], down: int, up: int, prctl: Any, parent: int
) -> None:  # pragma: no cover (runs in the child)
    """The forked child: read each index sent, answer one byte; at EOF (or on anything
    unexpected) exit without running the parent's exit hooks."""
    code = 0
    try:
        if prctl is not None:  # killed when its producer dies: no hung read left behind
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)
        with contextlib.suppress(Exception):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort dumps no core
        faulthandler.disable()  # its death is reported by the parent, not dumped
        while True:
            raw = _read_exact(down, _INDEX.size)
            if raw is None:
                break
            with contextlib.suppress(Exception):  # a read that raises raises in-process too
                read(_INDEX.unpack(raw)[0])
            os.write(up, _OK)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _read_exact(fd: int, size: int) -> bytes | None:  # pragma: no cover (the child's)
    """``size`` bytes from ``fd``, None at EOF."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # pragma: no cover - an exotic libc
        return None


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether ``fd`` became readable (an answer, or EOF: the child died) in time (a
    signal's interruption is retried by select itself, PEP 475)."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


def _how(status: int) -> str:
    """How the child ended, as the error names it ('SIGABRT', 'exit code 1')."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"signal {sig}"
    return f"exit code {os.WEXITSTATUS(status)}"
