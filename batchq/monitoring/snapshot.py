"""Raw reads of queues for monitoring: everything ``status``, ``top`` and the exporter show.

:func:`read_snapshots` reads any number of queues in one pipelined round trip (TIME and,
per queue, meta, LLEN of the data list, the producers' heartbeats, the stats, pstats and
trainer hashes, the dead list's length, the newest history samples, the oldest
element of the data list, the autoscalers' registry and their last decision, the
registry of groups, the quarantine hash's run and count), plus a second one only when
it needs what the first returned: the
lease lists of live producers (``leases=True``), the first 64 KiB of a frame stored by
reference when that is the oldest element, the ranks of a data-parallel trainer and the
groups of a run read by several (:mod:`batchq.monitoring.reader_snapshots`). Nothing here
writes.

Times are the Redis server's (``TIME``), so every viewer agrees on "now" and on which
producers are alive, whatever its own clock says.

Where a queue lives and, for a striped one, each stripe: a queue of N stripes
(:mod:`batchq.protocol.stripes`) is N queues, on a cluster each on a master of its own.
Its status row is stripe 0's (the queue itself: the trainer's figures, the producers,
the run) plus ``stripes``: per stripe its queue name, the node that holds it, its depth
(every rank's list), frames pushed and popped, and producers alive there.
:func:`read_stripes` reads them, one pipeline per master
(:func:`batchq.client.cluster.grouped`); ``node`` is where the client that read it is
bound: a cluster master's ``host:port``, a Sentinel master, or the one server's address.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from batchq.client.cluster import grouped
from batchq.client.connection import server_of
from batchq.errors import FrameError
from batchq.monitoring.reader_snapshots import (
    GroupSnapshot,
    RankSnapshot,
    file_group_read,
    file_rank_read,
    history_range,
    queue_group_reads,
    queue_rank_reads,
    samples,
    texts,
)
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import MetaField, StatsField, parse_producer_stat_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import time_ms
from batchq.protocol.words import as_int, as_text
from batchq.wire import codec
from batchq.wire.frame import decode_ref, is_ref

__all__ = [
    "HEADER_PEEK_BYTES",
    "QueueSnapshot",
    "StripeSnapshot",
    "read_snapshots",
    "read_stripes",
    "stripe_count",
]

#: How much of a frame stored by reference is read to find its header (GETRANGE 0 N-1).
HEADER_PEEK_BYTES = 65536


@dataclass
class QueueSnapshot:
    """What one read of a queue returned, decoded but not yet interpreted.

    Attributes:
        queue: the queue's name.
        now_ms: the Redis server's time of the read (ms since the epoch).
        meta: the meta hash (run, hwm, shards, claim, finished, ...).
        depth: LLEN of the data list.
        alive: live producer id -> heartbeat deadline (server ms), sorted by id.
        stats: the stats hash's counters.
        dead: length of the dead list.
        pstats: per-producer counters, ``{producer: {name: n}}`` with the names of
            :class:`batchq.protocol.fields.ProducerStat` (every producer that ever
            pushed, alive or not).
        trainer: the trainer hash (its figures as text, and ``updated_ms``).
        history: history samples, newest first (unparseable ones skipped).
        oldest_t: the producer wall time in the oldest frame's header, None when the
            list is empty, the frame has no time, or its header cannot be read.
        leases: shards leased by live producers, None when not read.
        autoscalers: live ``serve --workers auto`` registered on the queue.
        last_decision: the newest entry of the scalelog (parsed), None if none.
        ranks: each rank of a data-parallel trainer (meta ``world`` > 1), else empty.
        node: the server (a cluster's master, ``host:port``) the queue was read on.
        stripes: each stripe of a striped queue (meta ``stripes`` > 1), stripe 0 first
            (:class:`StripeSnapshot`), else empty.
        groups: each group of a run read by several groups (by slot), else empty.
        registry: the run's groups, name -> slot (empty for a run of one group).
        quarantine: the quarantine hash's ``run`` and ``count``: the examples that run
            replaced by substitutes ("" and 0 when none did).
    """

    queue: str
    now_ms: int
    meta: dict[str, str]
    depth: int
    alive: dict[str, float]
    stats: dict[str, int]
    dead: int
    pstats: dict[str, dict[str, int]]
    trainer: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)
    oldest_t: float | None = None
    leases: int | None = None
    autoscalers: int = 0
    last_decision: dict[str, Any] | None = None
    ranks: list[RankSnapshot] = field(default_factory=list)
    node: str = ""  # where it was read: batchq.client.connection.server_of
    stripes: list[StripeSnapshot] = field(default_factory=list)  # a striped queue's
    groups: list[GroupSnapshot] = field(default_factory=list)
    registry: dict[str, str] = field(default_factory=dict)
    quarantine: tuple[str, int] = ("", 0)

    @property
    def world(self) -> int:
        """The run's number of trainer ranks (1: a single trainer)."""
        return max(1, as_int(self.meta.get(MetaField.WORLD) or 1))

    @property
    def hwm(self) -> int:
        """The run's cap (0 before a producer joined)."""
        return as_int(self.meta.get(MetaField.HWM))

    @property
    def oldest_age_s(self) -> float | None:
        """Server time minus the oldest frame's producer time (clamped at 0), or None."""
        if self.oldest_t is None:
            return None
        return max(0.0, self.now_ms / 1000 - self.oldest_t)

    def figure(self, name: str) -> float | None:
        """One of the trainer's figures as a float, None if absent or malformed."""
        try:
            return float(self.trainer[name])
        except (KeyError, ValueError):
            return None


def _pstats(raw: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for key, value in raw.items():
        parsed = parse_producer_stat_field(as_text(key))
        if parsed:
            out.setdefault(parsed[0], {})[parsed[1]] = as_int(value)
    return out


def _header_time(buf: bytes | None) -> float | None:
    """The ``t`` of a frame's header, None if absent or unreadable."""
    if not buf:
        return None
    try:
        t = codec.peek_header(buf).get("t")
    except FrameError:
        return None
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


@dataclass
class StripeSnapshot:
    """One stripe of a queue as read (stripe 0: the queue itself)."""

    stripe: int
    queue: str
    node: str
    depth: int
    pushed: int
    popped: int
    producers_alive: int

    def row(self) -> dict[str, Any]:
        """As a status row's ``stripes`` entry."""
        return dict(vars(self))


def stripe_count(meta: dict[str, str]) -> int:
    """The stripes a queue's meta says its run has (1: not striped)."""
    return max(1, as_int(meta.get(MetaField.STRIPES) or 1))


def read_stripes(
    client: redis.Redis, queue: str, count: int, world: int, now_ms: int
) -> list[StripeSnapshot]:
    """Every stripe of ``queue`` striped ``count`` ways (stripe 0 too), in order."""
    keys = {str(k): QueueKeys(queue).stripe(k, count) for k in range(count)}
    out: dict[str, StripeSnapshot] = {}
    with grouped(client, {name: k.meta for name, k in keys.items()}) as groups:
        for node_client, names in groups:
            node = server_of(node_client)

            def reads(pipe: Any, names: list[str] = names) -> None:
                for name in names:
                    k = keys[name]
                    for data in k.rank_data(world) or [k.data]:
                        pipe.llen(data)
                    pipe.hmget(k.stats, [StatsField.PUSHED, StatsField.POPPED])
                    pipe.zcount(k.producers, now_ms, "+inf")

            replies = iter(execute_pipeline(node_client, reads))
            for name in names:
                lists = len(keys[name].rank_data(world)) or 1
                depth = sum(int(next(replies)) for _ in range(lists))
                pushed, popped = next(replies)
                out[name] = StripeSnapshot(
                    int(name), keys[name].queue, node, depth, as_int(pushed), as_int(popped),
                    int(next(replies)),
                )  # fmt: skip
    return [out[str(k)] for k in range(count)]


def read_snapshots(
    client: redis.Redis,
    queues: list[str],
    *,
    history: int = 60,
    leases: bool = True,
) -> list[QueueSnapshot]:
    """Read queues in one pipelined round trip (two when leases or a reference need it),
    per master on a cluster; a striped queue's stripes too.

    Args:
        client: a client returning bytes.
        queues: the queues' names.
        history: how many of the newest history samples to read (0: none, -1: all).
        leases: also count the shards leased by live producers (one LLEN each).

    Returns:
        One snapshot per queue, in order.

    Raises:
        ConnectionLost: the connection failed.
        redis.RedisError: Redis refused a read (a key of another type).
    """
    found: dict[str, QueueSnapshot] = {}
    with grouped(client, {q: QueueKeys(q).meta for q in queues}) as groups:
        for node_client, names in groups:
            for snap in _read_on(node_client, names, history, leases):
                snap.node = server_of(node_client)
                count = stripe_count(snap.meta)
                if count > 1:
                    snap.stripes = read_stripes(
                        node_client, snap.queue, count, snap.world, snap.now_ms
                    )
                found[snap.queue] = snap
    return [found[q] for q in queues]


def _read_on(
    client: redis.Redis, queues: list[str], history: int, leases: bool
) -> list[QueueSnapshot]:
    """:func:`read_snapshots` of queues that one client reaches."""
    keys = [QueueKeys(q) for q in queues]

    def first_reads(pipe: Any) -> None:
        pipe.time()
        for k in keys:
            _queue_reads(pipe, k, history)

    replies = execute_pipeline(client, first_reads)
    now_ms = time_ms(replies[0])
    firsts = [
        _from_replies(k, now_ms, replies[1 + i * _PER_QUEUE : 1 + (i + 1) * _PER_QUEUE], history)
        for i, k in enumerate(keys)
    ]
    # The second round trip: leases of live producers, headers of referenced frames, the
    # ranks of data-parallel trainers.
    todo: list[tuple[QueueSnapshot, str]] = []

    def later_reads(pipe: Any) -> None:
        for k, (snap, last) in zip(keys, firsts, strict=True):
            todo.extend((snap, what) for what in _later_reads(pipe, k, snap, last, history, leases))

    later = execute_pipeline(client, later_reads)
    for (snap, what), value in zip(todo, later, strict=True):
        _file_later(snap, what, value)
    return [snap for snap, _ in firsts]


_PER_QUEUE = 13  # the reads _queue_reads queues for each queue, in order


def _queue_reads(pipe: Any, k: QueueKeys, history: int) -> None:
    """The first round trip's reads of one queue (see :func:`_from_replies`)."""
    pipe.hgetall(k.meta)
    pipe.llen(k.data)
    pipe.zrange(k.producers, 0, -1, withscores=True)
    pipe.hgetall(k.stats)
    pipe.llen(k.dead)
    pipe.hgetall(k.pstats)
    pipe.hgetall(k.trainer)
    pipe.lrange(k.history, *history_range(history))
    pipe.lindex(k.data, -1)
    pipe.zrange(k.scalers, 0, -1, withscores=True)
    pipe.lindex(k.scalelog, 0)
    pipe.hgetall(k.groups)
    pipe.hmget(k.quarantine, ["run", "count"])


def _from_replies(
    k: QueueKeys, now_ms: int, replies: list[Any], history: int
) -> tuple[QueueSnapshot, bytes | None]:
    """One queue's snapshot from its first-round replies, and its oldest element."""
    meta, depth, producers, stats, dead, pstats, trainer, hist, last, scalers, decision = replies[
        :11
    ]
    groups = replies[11]  # the registry of a run read by several groups
    quarantine_run, quarantined = replies[12]
    alive = {as_text(p): float(s) for p, s in producers if float(s) >= now_ms}
    snap = QueueSnapshot(
        queue=k.queue,
        now_ms=now_ms,
        meta=texts(meta),
        depth=int(depth),
        alive=dict(sorted(alive.items())),
        stats={as_text(a): as_int(b) for a, b in stats.items()},
        dead=int(dead),
        pstats=_pstats(pstats),
        trainer=texts(trainer),
        history=samples(hist) if history else [],
        autoscalers=sum(1 for _, score in scalers if float(score) >= now_ms),
        last_decision=next(iter(samples([decision] if decision else [])), None),
        registry=texts(groups),
        quarantine=(as_text(quarantine_run) if quarantine_run else "", as_int(quarantined)),
    )
    return snap, last


def _later_reads(
    pipe: Any,
    k: QueueKeys,
    snap: QueueSnapshot,
    last: bytes | None,
    history: int,
    leases: bool,
) -> list[str]:
    """Queue the second round's reads of one queue; what each reply is, in order."""
    what = _group_reads(pipe, k, snap, history) + queue_rank_reads(pipe, k, snap.world, history)
    if leases:
        snap.leases = 0
        for p in snap.alive:
            pipe.llen(k.lease(p))
            what.append("lease")
    return what + _oldest_read(pipe, k, snap, last)


def _group_reads(pipe: Any, k: QueueKeys, snap: QueueSnapshot, history: int) -> list[str]:
    """Queue the reads of a run read by several groups (each group's); what each is."""
    if not snap.registry or not as_int(snap.meta.get(MetaField.GROUPS)):
        return []
    snap.groups = queue_group_reads(pipe, k, snap.registry, snap.meta, history)
    reads = ["group_depth"] * snap.world + ["group_stats", "group_trainer", "group_history"]
    return [f"{w}:{i}" for i in range(len(snap.groups)) for w in reads]


def _oldest_read(pipe: Any, k: QueueKeys, snap: QueueSnapshot, last: bytes | None) -> list[str]:
    """The oldest element's time: read from its header now, or, where it is a reference,
    the start of the frame it names queued (``["ref"]``; nothing for a bad reference)."""
    if last is None or not is_ref(last):
        snap.oldest_t = _header_time(last)
        return []
    try:
        ref = decode_ref(last, k.frame_prefix)
    except FrameError:
        return []
    pipe.getrange(ref, 0, HEADER_PEEK_BYTES - 1)
    return ["ref"]


def _file_later(snap: QueueSnapshot, what: str, value: Any) -> None:
    """File one second-round reply into its snapshot."""
    if what.startswith("group_"):
        name, i = what.split(":")
        file_group_read(snap.groups[int(i)], name, value)
    elif what.startswith("rank_"):
        file_rank_read(snap.ranks, what, value, snap.meta, snap.world)
    elif what == "lease":
        snap.leases = (snap.leases or 0) + int(value)
    else:
        snap.oldest_t = _header_time(value)
