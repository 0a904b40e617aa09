"""The scripts of work recovery, one typed function each (see
:mod:`batchq.protocol.calls`; used by :mod:`batchq.protocol.reaper`): the leases of
dead, leaving or killed producers (their connections closed) back to work (reap.lua),
and shards with a gap nobody can still deliver (requeue.lua).

What they count (``redone_shards``, ``reaped_closed``, ``stale_leases``) goes into the
queue's stats hash (``QueueKeys.queue_stats``) whichever group's view of the keys the
caller holds: the reader of group slot i > 0 reaps with its slot's keys, and a shard it
hands back is built again for the pool, so counted in ``stats@<i>`` it was missing from
the queue's figures (``status``, the exporter) and from what a test adds to its builds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import redis

from batchq.protocol.calls import Arg, CountReply, build_call, decode_reply
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import Status

__all__ = ["RequeueReply", "gone", "reap", "requeue"]


class RequeueReply(NamedTuple):
    """requeue.lua: ``{'OK', requeued shards...}`` or a status."""

    status: str
    requeued: list[int] = []  # a NamedTuple default, never mutated

    @classmethod
    def parse(cls, raw: Any) -> RequeueReply:
        """From requeue.lua's raw reply."""
        r = decode_reply(raw)
        return cls(r[0], [int(g) for g in r[1:]] if r[0] == Status.OK else [])


def _reap_keys(keys: QueueKeys) -> dict[str, str | None]:
    """The KEYS reap.lua names before its lease lists."""
    return {"incarnation": keys.incarnation, "producers": keys.producers, "work": keys.work,
            "stats": keys.queue_stats, "meta": keys.meta, "clients": keys.clients,
            "failures": keys.failures}  # fmt: skip


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
        _reap_keys(keys),
        {"incarnation": incarnation, "why": why},
        more_keys=[keys.leases[p] for p in producers],
        more_args=list(producers),
    ).run(client)  # fmt: skip


def gone(
    client: redis.Redis, keys: QueueKeys, *, incarnation: str, closed: Mapping[str, str]
) -> CountReply:
    """Reap producers whose connections closed (reap.lua, 'closed'); ``closed`` maps a
    producer to the ids found closed, '<main>,<heartbeat>'."""
    pairs: list[Arg] = []
    for producer, ids in closed.items():
        pairs += [producer, ids]
    return build_call(
        "reap",
        CountReply.parse,
        _reap_keys(keys),
        {"incarnation": incarnation, "why": "closed"},
        more_keys=[keys.leases[p] for p in closed],
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
    mask: int = 1,
) -> RequeueReply:
    """Hand shards with a gap back (requeue.lua).

    Args:
        data: the data list that must be empty (a rank's own).
        shards: candidate global shard numbers, oldest first.
        alive: the live producers (their leases are looked at).
        rank: a data-parallel rank's or a group slot's (its cursor field, 'next:<rank>',
            'next@<slot>[:<rank>]'; the candidates' local numbers).
        mask: the caller's group slot as a mask (1: slot 0, a run of one group).
    """
    tail: list[Arg] = [*shards, *alive]
    if rank is not None:
        tail += ["", rank[0], *rank[1]]
    return build_call(
        "requeue",
        RequeueReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work, "data": data,
         "stats": keys.queue_stats},
        {"incarnation": incarnation, "run": run, "n": len(shards), "mask": mask},
        more_keys=[keys.leases[p] for p in alive],
        more_args=tail,
    ).run(client)  # fmt: skip
