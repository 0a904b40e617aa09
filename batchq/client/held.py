"""The connection that the one thread owning a client's hot path uses, without the pool's
checks.

The pool's ``get_connection``/``release`` pair costs more client CPU than the round trip
it wraps: a ``select`` on the socket to check it holds no stale data, a pid check, and
redis-py's observability counters and events each way. Measured on this project's
2-core machine, a PING through the pool costs 130-150 us of client CPU, without them
65-80 us; the producer pushes and the trainer pops every batch this way.

A thread that owns a client (the producer's serving thread, the trainer's reader)
:func:`hold` s it. :func:`lua_scripts.round_trip` then :func:`borrow` s that thread's
connection: the one it used last, moved from the pool's idle list to its in-use set
under the pool's lock, and moved back by :func:`give_back`. Between round trips it is
an idle connection of the pool like any other, so the thread's other commands (redis-py's
own, which go through the pool) reuse it and the client keeps one connection, as before
(an extra one per process cost the maxmemory headroom that the trainer's claim needs,
tests/consumer/test_limits.py). Where another thread took it meanwhile, or the pool is
of a kind without those lists, or in a forked child, the round trip goes through the
pool as usual.

What the pool's checks gave is kept by the one caller, :func:`lua_scripts.round_trip`: a
connection that failed or was interrupted half-way is disconnected before anything reads
it again (it reconnects, authenticated, at its next use), so no one is handed a
connection that is out of step.
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
    conn: Any = None  # the owner's last connection (redis-py types them loosely)
    direct: bool = True  # the pool has the idle list and in-use set this module moves


# Keyed weakly: a client that is dropped takes its entry along.
_HELD: weakref.WeakKeyDictionary[redis.Redis, _Held] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# The process's pid, kept current across forks: os.getpid() is a system call per round
# trip otherwise.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


_POOL_PARTS = ("_lock", "_available_connections", "_in_use_connections")


def hold(client: redis.Redis) -> None:
    """The calling thread owns ``client``'s round trips from now on."""
    # redis-py's ConnectionPool has these (5.x to 8.x); another kind goes the usual way.
    direct = all(hasattr(client.connection_pool, part) for part in _POOL_PARTS)
    with _LOCK:
        _HELD[client] = _Held(threading.get_ident(), _pid, direct=direct)


def release(client: redis.Redis) -> None:
    """The owner stops (its close): round trips go through the pool again (idempotent)."""
    with _LOCK:
        _HELD.pop(client, None)


def borrow(client: redis.Redis) -> tuple[Any, bool]:
    """A connection for one round trip: ``(conn, direct)``; give it back with
    :func:`give_back`."""
    held = _HELD.get(client)
    pool: Any = client.connection_pool
    if held is None or held.thread != threading.get_ident() or held.pid != _pid:
        return pool.get_connection(), False
    conn = held.conn
    if conn is not None and held.direct:
        with pool._lock:
            if conn in pool._available_connections:
                pool._available_connections.remove(conn)
                pool._in_use_connections.add(conn)
                return conn, True
        # Another thread has it (or the pool dropped it): take one the usual way.
    # Lent the usual way this time (and given back so): the next round trip takes it
    # directly.
    held.conn = pool.get_connection()
    return held.conn, False


def give_back(client: redis.Redis, conn: Any, direct: bool) -> None:
    """End a round trip started with :func:`borrow`."""
    pool: Any = client.connection_pool
    if direct:
        with pool._lock:
            if conn in pool._in_use_connections:
                pool._in_use_connections.remove(conn)
                pool._available_connections.append(conn)
                return
        # The pool forgot it (reset): it is not the pool's to take back.
        conn.disconnect()
        return
    pool.release(conn)
