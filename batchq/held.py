"""A connection held by the one thread that owns a client's hot path.

The pool's ``get_connection``/``release`` pair costs more client CPU than the round trip
it wraps: a ``select`` on the socket to check it holds no stale data, two locks, a pid
check and redis-py's observability counters each way. Measured on this project's 2-core
machine, a PING through the pool costs 130-150 us of client CPU, on a held connection
65-80 us; the producer pushes and the trainer pops every batch this way.

A thread that owns a client (the producer's serving thread, the trainer's reader)
:func:`hold` s it: :func:`lua_scripts.round_trip` then takes that thread's connection
from here instead of the pool, and every other thread (or a forked child) still goes
through the pool. What the pool's checks gave is kept by the one caller,
:func:`lua_scripts.round_trip`: a connection that failed or was interrupted half-way is
disconnected before anything else reads it (it reconnects, authenticated, on its next
use), so a held connection is never out of step. :func:`release` gives it back (the
owner's close); a client dropped without it takes its held connection along.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["borrow", "give_back", "hold", "release"]


@dataclass
class _Held:
    thread: int  # the owner's threading.get_ident()
    pid: int  # the process that held it: a forked child uses the pool
    conn: Any = None  # redis-py types its connections loosely


# Keyed weakly: a client that is dropped takes its entry (and its connection) along.
_HELD: weakref.WeakKeyDictionary[redis.Redis, _Held] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# The process's pid, kept current across forks: os.getpid() is a system call per round
# trip otherwise.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def hold(client: redis.Redis) -> None:
    """The calling thread owns ``client``'s round trips from now on: they reuse one
    connection, taken from the pool at the first one."""
    with _LOCK:
        _HELD[client] = _Held(threading.get_ident(), _pid)


def release(client: redis.Redis) -> None:
    """Give the held connection back to the pool (idempotent; any thread)."""
    with _LOCK:
        held = _HELD.pop(client, None)
    if held is not None and held.conn is not None and held.pid == _pid:
        client.connection_pool.release(held.conn)


def borrow(client: redis.Redis) -> tuple[Any, bool]:
    """A connection for one round trip: ``(conn, held)``; a connection that is not held
    goes back with :func:`give_back`."""
    held = _HELD.get(client)
    if held is None or held.thread != threading.get_ident() or held.pid != _pid:
        return client.connection_pool.get_connection(), False
    if held.conn is None:
        held.conn = client.connection_pool.get_connection()
    return held.conn, True


def give_back(client: redis.Redis, conn: Any, held: bool) -> None:
    """End a round trip started with :func:`borrow`."""
    if not held:
        client.connection_pool.release(conn)
