"""The producer's scripts, one typed function each (see :mod:`batchq.protocol.scripts`):
joining a run (join.lua), a lease (lease.lua) and the capped push (push.lua), which
travel in pipelines and are built as a :class:`~batchq.protocol.calls.Call`, a failed
attempt (fail.lua) and a shard handed back untouched (handback.lua).
"""

from __future__ import annotations

import redis

from batchq.protocol.calls import Arg, Call, build_call
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import entry_slot, flag
from batchq.protocol.replies import CountReply, JoinReply, LeaseReply, PushReply, StatusReply

__all__ = ["fail", "handback", "join", "lease_call", "push_call"]


def join(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    producer: str,
    fingerprint: str,
    hwm: int,
    shards: int,
    window: int,
    new_run: str,
    new_incarnation: str,
    heartbeat_ttl_ms: int,
    version: str,
    epoch_batches: int | None,
    served: str,
    grace_ms: int,
    no_create: bool,
    shard_batches: int | None = None,
) -> JoinReply:
    """A producer joins the queue's run (join.lua); ``shard_batches``: the plan's
    batches per full shard (None: it cannot count them, published as 0)."""
    return build_call(
        "join",
        JoinReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "producers": keys.producers,
         "lease": keys.lease(producer), "work": keys.work, "data": keys.data,
         "failures": keys.failures, "ledger": keys.ledger},
        {"producer": producer, "fingerprint": fingerprint, "hwm": hwm, "shards": shards,
         "window": window, "new_run": new_run, "new_incarnation": new_incarnation,
         "heartbeat_ttl_ms": heartbeat_ttl_ms, "version": version,
         "epoch_batches": -1 if epoch_batches is None else epoch_batches,
         "served": served, "grace_ms": grace_ms, "no_create": flag(no_create),
         "shard_batches": shard_batches or 0},
    ).run(client)  # fmt: skip


def lease_call(
    keys: QueueKeys,
    *,
    incarnation: str,
    run: str,
    producer: str,
    token: str,
    heartbeat_ttl_ms: int,
    prefetch: int,
    world: int,
    after: str = "",
) -> Call[LeaseReply]:
    """A producer's next lease (lease.lua); a data-parallel run (``world`` > 1) adds
    every rank's data list and the remap hash. ``prefetch`` k > 0: it rides behind the
    last push of the shard whose lease entry is ``after``, and is granted only if that
    push went through and the producer then holds fewer than k leases."""
    tail = [*keys.rank_data(world), keys.remap] if world > 1 else []
    return build_call(
        "lease",
        LeaseReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work,
         "lease": keys.lease(producer), "producers": keys.producers, "ledger": keys.ledger},
        {"incarnation": incarnation, "run": run, "producer": producer, "token": token,
         "heartbeat_ttl_ms": heartbeat_ttl_ms, "prefetch": int(prefetch), "after": after},
        more_keys=tail,
    )  # fmt: skip


def push_call(
    keys: QueueKeys,
    *,
    data: str,
    frame_key: str | None,
    incarnation: str,
    run: str,
    producer: str,
    entry: str,
    element: Arg,
    last: bool,
    heartbeat_ttl_ms: int,
    frame_bytes: int,
    blocked_ms: int,
    produce_ms: int,
    shm_host: str = "",
    host_field: str = MetaField.SHM_HOST,
) -> Call[PushReply]:
    """The capped push of one frame (push.lua) into ``data`` (a rank's list, or the
    queue's); ``frame_key`` names a frame stored by reference (None: inline).
    ``shm_host``: the element is a shared-memory descriptor of that host, pushed only
    while meta's ``host_field`` (the rank's published host) says the same."""
    return build_call(
        "push",
        PushReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "data": data,
         "stats": keys.stats, "producers": keys.producers, "lease": keys.lease(producer),
         "pstats": keys.pstats, "frame": frame_key},
        {"incarnation": incarnation, "run": run, "producer": producer, "entry": entry,
         "element": element, "last": flag(last), "heartbeat_ttl_ms": heartbeat_ttl_ms,
         "frame_bytes": frame_bytes, "blocked_ms": blocked_ms, "produce_ms": produce_ms,
         "shm_host": shm_host, "host_field": host_field},
    )  # fmt: skip


def _shard_keys(keys: QueueKeys, producer: str) -> dict[str, str | None]:
    return {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work,
            "lease": keys.lease(producer)}  # fmt: skip


def fail(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    incarnation: str,
    run: str,
    producer: str,
    entry: str,
    max_attempts: int,
) -> CountReply:
    """Count a failed attempt at a shard (fail.lua): RETRY or GIVE_UP with ``first``
    the attempts so far."""
    return build_call(
        "fail",
        CountReply.parse,
        {**_shard_keys(keys, producer), "failures": keys.failures, "stats": keys.stats},
        {"incarnation": incarnation, "run": run, "entry": entry, "g": entry_slot(entry),
         "max_attempts": max_attempts},
    ).run(client)  # fmt: skip


def handback(
    client: redis.Redis, keys: QueueKeys, *, incarnation: str, run: str, producer: str, entry: str
) -> StatusReply:
    """Give a leased shard back untouched (handback.lua)."""
    return build_call(
        "handback",
        StatusReply.parse,
        _shard_keys(keys, producer),
        {"incarnation": incarnation, "run": run, "entry": entry, "g": entry_slot(entry)},
    ).run(client)
