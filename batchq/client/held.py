"""The connection that the one thread owning a client's hot path uses, without the pool's
checks.

A thread that owns a client (the producer's serving thread, the trainer's reader)
:func:`hold` s it; :func:`batchq.protocol.calls.round_trip` then borrows that thread's
connection and gives it back (:func:`batchq.client.redis_internals.borrow`). The state
lives in the client's own pool (:class:`batchq.client.redis_internals.HeldPool`, which
every client of
:func:`batchq.client.connection.make_client` has): there is no registry, and a client
whose pool is of another kind goes through its pool as usual.

What the pool's checks gave is kept by the one caller, ``round_trip``: a connection that
failed or was interrupted half-way is disconnected before anything reads it again (it
reconnects, authenticated, at its next use), so no one is handed a connection that is
out of step.
"""

from __future__ import annotations

import redis

from batchq.client.redis_internals import HeldPool

__all__ = ["hold", "release"]


def hold(client: redis.Redis) -> None:
    """The calling thread owns ``client``'s round trips from now on."""
    pool = client.connection_pool
    if isinstance(pool, HeldPool):
        pool.hold()


def release(client: redis.Redis) -> None:
    """The owner stops (its close): round trips go through the pool again (idempotent)."""
    pool = client.connection_pool
    if isinstance(pool, HeldPool):
        pool.release_hold()
