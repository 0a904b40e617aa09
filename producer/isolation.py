"""Isolation: a shard that failed before is built with each example's read tried first
in a forked child, so an example that kills its process (a native crash: SIGSEGV,
SIGABRT) or never returns is found, named and handled like one that raises.

A producer that dies while building a shard cannot say which example killed it, and a
build past ``build_timeout_s`` cannot be interrupted. So a shard whose earlier attempt
failed (raised, timed out, or its producer died: lease.lua's ``attempts``) is built
*isolated*: before the stream reads example i in-process, :func:`try_in_child` reads it
in a child forked from the producer, which reports back through a pipe and exits. The
child dying by a signal, or not answering within ``timeout_s`` (then it is killed), is
:class:`producer.errors.ExampleKilled` naming the example and how, raised where the read
would have raised: with ``on_sample_error='quarantine'`` the example is recorded and
replaced like one that raised (:mod:`producer.quarantine`), else the shard's attempt
fails (fail.lua) and after ``max_attempts`` the trainer gets ``ProducerFailed`` naming
it. The survivor, not the dead process, reports: an outside kill (the OOM killer, an
operator) of a producer only makes the next builder of its shards isolate them, never
condemns an example. What the child read is thrown away (nothing crosses the pipe but a
byte); the parent then reads the example itself, so the batch is the one any producer
builds (whether an example kills is taken as a property of the example, as whether it
raises is). Only isolated shards pay the fork and the second read.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Any

from producer.errors import ExampleKilled
from producer.serving.sharding import find_root

__all__ = ["isolation_of", "try_in_child"]

_OK = b"."
_PR_SET_PDEATHSIG = 1


def try_in_child(read: Callable[[], Any], what: str, timeout_s: float | None) -> None:
    """Run ``read()`` in a forked child: return once it returned or raised there.

    Args:
        read: reads what is tried (its result and what it raises are the child's).
        what: what it reads ('example 7'), for the error's message.
        timeout_s: the longest the child may take (None: no limit).

    Raises:
        ExampleKilled: the child died by a signal, or did not answer within timeout_s
            (then it was killed).
    """
    prctl = _prctl()  # loaded here: no dlopen in a child forked beside other threads
    parent = os.getpid()
    out, into = os.pipe()
    with warnings.catch_warnings():  # fork beside the heartbeat thread: the child only reads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover (the child: coverage does not follow it)
        os.close(out)
        _child(read, into, prctl, parent)
    os.close(into)
    try:
        answered = _wait_readable(out, timeout_s)
        byte = os.read(out, 1) if answered else b""
    finally:
        os.close(out)
    if not answered:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if byte == _OK:
        return
    if not answered:
        raise ExampleKilled(
            f"{what} never returned: no result after build_timeout_s={timeout_s} "
            "(read in a forked child, stopped)"
        )
    raise ExampleKilled(f"the producer died ({_how(status)}) building {what}")


def isolation_of(stream: Any) -> Callable[[bool, float | None], None] | None:
    """``(on, timeout_s) -> None``: turns isolation on or off for the shard built next,
    where the root of ``stream`` reads example by example (its ``isolate``, as
    :class:`producer.torch.dataset.DatasetStream`'s); None where it does not."""
    isolate = getattr(find_root(stream), "isolate", None)
    return isolate if callable(isolate) else None


def _child(read: Callable[[], Any], into: int, prctl: Any, parent: int) -> None:  # pragma: no cover
    """The forked child: read, answer, exit without running the parent's exit hooks."""
    code = 0
    try:
        if prctl is not None:  # killed when its producer dies: no hung read left behind
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)
        with contextlib.suppress(Exception):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort dumps no core
        with contextlib.suppress(Exception):  # a read that raises raises in-process too
            read()
        os.write(into, _OK)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # pragma: no cover - an exotic libc
        return None


def _wait_readable(fd: int, timeout_s: float | None) -> bool:
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
