"""The producer's scripts, one typed function each (see :mod:`batchq.protocol.calls`):
joining a run (join.lua), a lease (lease.lua) and the capped push (push.lua) in a run
read by one group or several (:mod:`batchq.protocol.groups`), which travel in pipelines
and are built as a :class:`~batchq.protocol.calls.Call`, a leased shard handed back
(handback.lua: untouched, or a failed attempt) and an example replaced by a substitute
(quarantine.lua).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from batchq.errors import ConfigError
from batchq.protocol.calls import (
    Arg,
    Call,
    CountReply,
    StatusReply,
    build_call,
    decode_reply,
    reply_int,
)
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import FLAGS, QUARANTINE_CAP
from batchq.protocol.words import Status

__all__ = [
    "JoinReply",
    "LeaseReply",
    "PushReply",
    "fail",
    "handback",
    "join",
    "lease_call",
    "push_call",
    "quarantine",
]


class JoinReply(NamedTuple):
    """join.lua: ``{'OK', incarnation, run, hwm, S, window, created[, world[, groups]]}``,
    ``{'MISMATCH', what, expected}`` or a status (``world``: the ranks of the run's
    data-parallel trainer, :mod:`batchq.protocol.ranks`; ``groups``: the group slots of a
    run read by several groups, 0 for one)."""

    status: str
    incarnation: str = ""
    run: str = ""
    hwm: str = ""
    shards: int = 0
    window: int = 0
    created: bool = False
    world: int = 1
    what: str = ""
    expected: str = ""
    groups: int = 0

    @classmethod
    def parse(cls, raw: Any) -> JoinReply:
        """From join.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.MISMATCH:
            return cls(r[0], what=str(r[1]), expected=str(r[2]))
        if r[0] != Status.OK:
            return cls(r[0])
        return cls(r[0], r[1], r[2], str(r[3]), int(r[4]), int(r[5]), bool(int(r[6])),
                   reply_int(r, 7, 1), groups=reply_int(r, 8))  # fmt: skip


class LeaseReply(NamedTuple):
    """lease.lua: ``{'OK', g, skip, slots, world, mask, params stamp, attempts[, shard]}``,
    ``{'WAIT', slot}``, ``{'GROUPS', n}`` or a status.

    ``g``: the global slot number (epoch x slots + slot, :mod:`batchq.protocol.ranks`);
    ``skip``: the batches the group that has fewest of the shard already has; ``slots``
    is 0 in a world-1 run of one group (the plan's S is the caller's); ``mask``: the
    group slots the shard is built for (1: slot 0 alone); ``params``: meta's params
    stamp ('<run>:<version>' of the params log, '' for none); ``attempts``: the shard's
    failed attempts so far (raised, timed out, or its producer died); ``shard``: the shard a
    remapped slot builds; with GROUPS, ``groups`` is the run's group slots; with WAIT,
    ``slot`` is the group whose floor holds the shared stream, -1 for none.
    """

    status: str
    g: int = 0
    skip: int = 0
    slots: int = 0
    world: int = 1
    shard: int | None = None
    params: str = ""
    mask: int = 1
    groups: int = 0
    slot: int = -1
    attempts: int = 0

    @classmethod
    def parse(cls, raw: Any) -> LeaseReply:
        """From lease.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.GROUPS:
            return cls(r[0], groups=reply_int(r, 1))
        if r[0] == Status.WAIT:
            return cls(r[0], slot=reply_int(r, 1, -1))
        if r[0] != Status.OK:
            return cls(r[0])
        shard = int(r[8]) if len(r) > 8 else None
        return cls(
            r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), shard, str(r[6]), int(r[5]),
            attempts=reply_int(r, 7),
        )  # fmt: skip


class PushReply(NamedTuple):
    """push.lua: ``{'OK', depth, dropped}``, ``{'FULL', depth[, slot]}``, ``{'DROPPED',
    mask}``, ``{'WRONG_TYPE', key, type}`` or a status (``depth``: OK's, the shortest list
    the frame went into, after it; FULL's, the full list's; ``dropped``: the group slots
    whose full lists the frame left out, their shard gone back for them; ``slot``:
    FULL's, the group whose list is full and paces the others, -1 in a run of one
    group)."""

    status: str
    depth: int = 0
    dropped: int = 0
    key: str = ""
    found: str = ""
    slot: int = -1

    @classmethod
    def parse(cls, raw: Any) -> PushReply:
        """From push.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.WRONG_TYPE:
            return cls(r[0], key=str(r[1]), found=str(r[2]))
        if r[0] == Status.DROPPED:
            return cls(r[0], dropped=reply_int(r, 1))
        if r[0] == Status.FULL:
            return cls(r[0], reply_int(r, 1), slot=reply_int(r, 2, -1))
        return cls(r[0], reply_int(r, 1), reply_int(r, 2))


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
    age_ms: int,
    no_create: bool,
    shard_batches: int | None = None,
    stripes: int = 1,
) -> JoinReply:
    """A producer joins the queue's run (join.lua); ``shard_batches``: the plan's
    batches per full shard (None: it cannot count them, published as 0); ``stripes``:
    the run's stripes (:mod:`batchq.protocol.stripes`), set with the plan, then
    checked. The join that publishes the plan wakes the trainer's ranks that claimed the
    run and wait for it, and the ``len()`` callers in ``keys.planwait`` (a wake token
    each, on ``keys.wake``)."""
    return build_call(
        "join",
        JoinReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "producers": keys.producers,
         "lease": keys.leases[producer], "work": keys.work, "data": keys.data,
         "failures": keys.failures, "ledger": keys.ledger, "stats": keys.queue_stats,
         "wake": keys.wake, "planwait": keys.planwait},
        {"producer": producer, "fingerprint": fingerprint, "hwm": hwm, "shards": shards,
         "window": window, "new_run": new_run, "new_incarnation": new_incarnation,
         "heartbeat_ttl_ms": heartbeat_ttl_ms, "version": version,
         "epoch_batches": -1 if epoch_batches is None else epoch_batches,
         "age_ms": age_ms, "no_create": FLAGS[no_create],
         "shard_batches": shard_batches or 0, "stripes": stripes},
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
    world: int | tuple[int, ...],
    groups: int = 0,
    after: str = "",
) -> Call[LeaseReply]:
    """A producer's next lease (lease.lua) in a run of ``groups`` group slots (0: one
    group) and ``world`` ranks (a tuple: each slot's). ``prefetch`` k > 0: it rides
    behind the last push of the shard whose lease entry is ``after``, and is granted only
    if that push went through and the producer then holds fewer than k leases; ``token``
    is unique per request (a retried request with the same token gets the same shard)."""
    return build_call(
        "lease",
        LeaseReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work,
         "lease": keys.leases[producer], "producers": keys.producers,
         "failures": keys.failures},
        {"incarnation": incarnation, "run": run, "producer": producer, "token": token,
         "heartbeat_ttl_ms": heartbeat_ttl_ms, "prefetch": int(prefetch), "after": after,
         "groups": groups},
        more_keys=keys.lease_tails[groups, world],
    )  # fmt: skip


def push_call(
    keys: QueueKeys,
    *,
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
    frame_key: str | None,
    rank: int = 0,
    world: int = 1,
    targets: int = 1,
    groups: int = 0,
    shm_host: str = "",
) -> Call[PushReply]:
    """The capped push of one frame (push.lua) into rank ``rank``'s list of every group
    slot of ``targets`` (a mask; 1: slot 0) in a run of ``groups`` group slots as the
    producer knows it (0: one group) and ``world`` ranks; ``last``: the shard's last
    frame; ``frame_key`` names a frame stored by reference (None: inline);
    ``shm_host``: the element is a shared-memory descriptor of that host, pushed only
    into lists whose trainers published it; the ms figures go into the producer's
    stats."""
    tail = keys.push_tails[targets, rank, world]
    return build_call(
        "push",
        PushReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "stats": keys.stats,
         "producers": keys.producers, "lease": keys.leases[producer],
         "pstats": keys.pstats, "refs": keys.refs, "work": keys.work},
        {"incarnation": incarnation, "run": run, "producer": producer, "entry": entry,
         "element": element, "last": FLAGS[last], "heartbeat_ttl_ms": heartbeat_ttl_ms,
         "frame_bytes": frame_bytes, "blocked_ms": blocked_ms, "produce_ms": produce_ms,
         "shm_host": shm_host, "rank": rank, "world": world, "targets": targets,
         "groups": groups, "by_ref": FLAGS[frame_key is not None]},
        more_keys=tail if frame_key is None else [*tail, frame_key],
    )  # fmt: skip


def _handback_keys(keys: QueueKeys, producer: str) -> dict[str, str | None]:
    """The KEYS of handback.lua."""
    return {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work,
            "lease": keys.leases[producer], "failures": keys.failures,
            "stats": keys.stats}  # fmt: skip


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
    """Count a failed attempt at a shard (handback.lua): RETRY or GIVE_UP with ``first``
    the attempts so far.

    Raises:
        ConfigError: ``max_attempts`` < 1 (0 is handback.lua's untouched handback, which
            counts nothing).
    """
    if max_attempts < 1:
        raise ConfigError(f"max_attempts={max_attempts!r}: expected an integer >= 1")
    return build_call(
        "handback",
        CountReply.parse,
        _handback_keys(keys, producer),
        {"incarnation": incarnation, "run": run, "entry": entry,
         "max_attempts": max_attempts},
    ).run(client)  # fmt: skip


def handback(
    client: redis.Redis, keys: QueueKeys, *, incarnation: str, run: str, producer: str, entry: str
) -> StatusReply:
    """Give a leased shard back untouched (handback.lua, max_attempts 0)."""
    return build_call(
        "handback",
        StatusReply.parse,
        _handback_keys(keys, producer),
        {"incarnation": incarnation, "run": run, "entry": entry, "max_attempts": 0},
    ).run(client)


def quarantine(
    client: redis.Redis, keys: QueueKeys, *, incarnation: str, run: str, index: int, record: str
) -> CountReply:
    """Record example ``index`` of the run as quarantined (quarantine.lua; ``record``:
    :func:`batchq.protocol.layout.quarantine_record`): ``first`` is how many examples
    the run quarantined so far."""
    return build_call(
        "quarantine",
        CountReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "quarantine": keys.quarantine,
         "stats": keys.stats},
        {"incarnation": incarnation, "run": run, "index": index, "record": record,
         "cap": QUARANTINE_CAP},
    ).run(client)  # fmt: skip
