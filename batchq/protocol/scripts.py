"""One typed function per Lua script: keys from :class:`QueueKeys`, arguments by name,
a typed reply (:mod:`batchq.protocol.replies`).

Each function names every KEYS and ARGV local of its script's header;
:func:`batchq.protocol.calls.build_call` puts them in the header's order and refuses a
name the header does not declare, so a wrapper and its script cannot disagree silently
(tests/batchq/protocol/test_lua_headers.py runs each wrapper against its header). The two
scripts that travel in pipelines (push, lease) are built as a :class:`Call`
(``push_call(...)``, then ``.run(client)`` or ``.queue(pipe)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import redis

from batchq.protocol.calls import (
    SCRIPTS,
    Arg,
    Call,
    Script,
    build_call,
    execute_pipeline,
    load_all,
)
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import HISTORY_CAP, WAKE_CAP, entry_slot
from batchq.protocol.replies import (
    ClaimReply,
    CountReply,
    JoinReply,
    LeaseReply,
    PopReply,
    PushReply,
    RequeueReply,
    StatusReply,
)

__all__ = [
    "SCRIPTS",
    "Call",
    "Script",
    "claim",
    "execute_pipeline",
    "fail",
    "gone",
    "handback",
    "join",
    "lease_call",
    "load_all",
    "pop",
    "push_call",
    "reap",
    "requeue",
    "resume",
]

ClaimOp = Literal["acquire", "refresh", "release", "finish"]


def _flag(value: bool) -> str:
    return "1" if value else "0"


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
) -> JoinReply:
    """A producer joins the queue's run (join.lua)."""
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
         "served": served, "grace_ms": grace_ms, "no_create": _flag(no_create)},
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
         "element": element, "last": _flag(last), "heartbeat_ttl_ms": heartbeat_ttl_ms,
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


def reap(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    incarnation: str,
    why: Literal["dead", "leave"],
    producers: Sequence[str],
) -> CountReply:
    """Hand dead (or leaving) producers' leases back (reap.lua): ``first`` producers
    reaped, ``second`` shards returned."""
    return build_call(
        "reap",
        CountReply.parse,
        {"incarnation": keys.incarnation, "producers": keys.producers, "work": keys.work,
         "stats": keys.stats},
        {"incarnation": incarnation, "why": why},
        more_keys=[keys.lease(p) for p in producers],
        more_args=list(producers),
    ).run(client)  # fmt: skip


def gone(
    client: redis.Redis, keys: QueueKeys, *, incarnation: str, closed: Mapping[str, str]
) -> CountReply:
    """Reap producers whose connections closed (gone.lua); ``closed`` maps a producer
    to the ids found closed, '<main>,<heartbeat>'."""
    pairs: list[Arg] = []
    for producer, ids in closed.items():
        pairs += [producer, ids]
    return build_call(
        "gone",
        CountReply.parse,
        {"incarnation": keys.incarnation, "producers": keys.producers, "work": keys.work,
         "stats": keys.stats, "clients": keys.clients},
        {"incarnation": incarnation},
        more_keys=[keys.lease(p) for p in closed],
        more_args=pairs,
    ).run(client)  # fmt: skip


def requeue(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    incarnation: str,
    run: str,
    data: str,
    shards: Sequence[int],
    alive: Sequence[str],
    rank: tuple[str, Sequence[int]] | None = None,
) -> RequeueReply:
    """Hand shards with a gap back (requeue.lua).

    Args:
        data: the data list that must be empty (a rank's own).
        shards: candidate global shard numbers, oldest first.
        alive: the live producers (their leases are looked at).
        rank: a data-parallel rank's ('next:<rank>' field, the candidates' local numbers).
    """
    tail: list[Arg] = [*shards, *alive]
    if rank is not None:
        tail += ["", rank[0], *rank[1]]
    return build_call(
        "requeue",
        RequeueReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work, "data": data,
         "producers": keys.producers, "stats": keys.stats},
        {"incarnation": incarnation, "run": run, "n": len(shards)},
        more_keys=[keys.lease(p) for p in alive],
        more_args=tail,
    ).run(client)  # fmt: skip


def _trainer_keys(keys: QueueKeys) -> dict[str, str | None]:
    return {"meta": keys.meta, "incarnation": keys.incarnation, "data": keys.data,
            "work": keys.work}  # fmt: skip


def claim(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    op: ClaimOp,
    token: str,
    claim_ttl_ms: int,
    run_id: str,
    new_incarnation: str,
    takeover_run: str,
    version: str,
    rank: int,
    world: int,
    even: str,
    resumed: str,
    incarnation: str = "",
    rank_lists: Sequence[str] = (),
) -> ClaimReply:
    """Acquire, refresh, release or finish a trainer's claim (claim.lua).

    Args:
        incarnation: refresh, release, finish: the queue's incarnation the claim was
            made in; another (Redis lost the queue) answers STATE_LOST.
        rank_lists: what a new or finished run drops besides the queue's own lists
            (data-parallel: every rank's data list, the counts and remap hashes).
    """
    return build_call(
        "claim",
        ClaimReply.parse,
        {**_trainer_keys(keys), "wake": keys.wake, "failures": keys.failures,
         "ledger": keys.ledger},
        {"token": token, "claim_ttl_ms": claim_ttl_ms, "op": op, "run_id": run_id,
         "new_incarnation": new_incarnation, "takeover_run": takeover_run,
         "version": version, "rank": rank, "world": world, "even": even,
         "resumed": resumed, "incarnation": incarnation},
        more_keys=rank_lists,
    ).run(client)  # fmt: skip


def pop(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    data: str,
    trainer: str,
    history: str,
    incarnation: str,
    run: str,
    token: str,
    room: int,
    floor: int,
    claim_ttl_ms: int,
    extra_popped: int,
    nbytes: int,
    figures: Sequence[Arg],
    suffix: str,
) -> PopReply:
    """The trainer's pop and accounting (pop.lua).

    Args:
        data, trainer, history: this rank's data list, figures hash and history list.
        figures: what :meth:`consumer.stats.TrainerStats.drain` returns (6 values):
            waited ms, busy ms, epochs, histogram increments, figures JSON, history
            sample JSON.
    """
    waited_ms, busy_ms, epochs, buckets, figures_json, sample = figures
    return build_call(
        "pop",
        PopReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "data": data,
         "wake": keys.wake, "stats": keys.stats, "producers": keys.producers,
         "trainer": trainer, "history": history, "pstats": keys.pstats},
        {"incarnation": incarnation, "run": run, "token": token, "room": room,
         "floor": floor, "claim_ttl_ms": claim_ttl_ms, "extra_popped": extra_popped,
         "nbytes": nbytes, "waited_ms": waited_ms, "busy_ms": busy_ms, "epochs": epochs,
         "buckets": buckets, "figures": figures_json, "sample": sample, "sfx": suffix,
         "wake_cap": WAKE_CAP, "history_cap": HISTORY_CAP},
    ).run(client)  # fmt: skip


def resume(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    rank_lists: Sequence[str],
    token: str,
    new_run: str,
    first: int,
    fingerprint: str,
    hwm: int | str,
    shards: int,
    window: int,
    epoch_batches: int,
    rank: int,
    world: int,
    even: str,
    step: int,
    held: bool,
    remap: tuple[int, Mapping[int, int]] | None,
    ledger: Sequence[tuple[str, str]],
) -> CountReply:
    """Restart the plan from a ledger (resume.lua): ``text`` is the run on OK, the
    run's step on STEP.

    Args:
        rank_lists: data-parallel: this rank's data list first, the others', the counts
            and remap hashes (remap last).
        remap: (epoch, slot -> shard) of a job resumed with another number of ranks.
        ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
    """
    tail: list[Arg] = []
    for slot, shard in (remap[1] if remap else {}).items():
        tail += [slot, shard]
    for field, value in ledger:
        tail += [field, value]
    return build_call(
        "resume",
        CountReply.parse,
        {**_trainer_keys(keys), "failures": keys.failures, "ledger": keys.ledger,
         "wake": keys.wake},
        {"token": token, "new_run": new_run, "first": first, "fingerprint": fingerprint,
         "hwm": hwm, "shards": shards, "window": window, "epoch_batches": epoch_batches,
         "rank": rank, "world": world, "even": even, "step": step, "held": _flag(held),
         "remap_epoch": "" if remap is None else remap[0],
         "remapped": 0 if remap is None else len(remap[1]), "wake_cap": WAKE_CAP},
        more_keys=rank_lists,
        more_args=tail,
    ).run(client)  # fmt: skip
