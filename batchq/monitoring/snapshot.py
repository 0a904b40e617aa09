"""Raw reads of queues for monitoring: everything ``status``, ``top`` and the exporter show.

:func:`read_snapshots` reads any number of queues in one pipelined round trip (TIME and,
per queue, meta, LLEN of the data list, the producers' heartbeats, the stats, pstats and
trainer hashes, the dead list's length, the newest history samples, the oldest
element of the data list, the autoscalers' registry and their last decision, the
registry of groups), plus a second one only when it needs what the first returned: the
lease lists of live producers (``leases=True``), the first 64 KiB of a frame stored by
reference when that is the oldest element, the ranks of a data-parallel trainer and the
groups of a run read by several (:mod:`batchq.monitoring.group_snapshot`). Nothing here
writes.

Times are the Redis server's (``TIME``), so every viewer agrees on "now" and on which
producers are alive, whatever its own clock says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from batchq.client.cluster import grouped
from batchq.client.connection import server_of
from batchq.errors import FrameError
from batchq.monitoring.group_snapshot import GroupSnapshot, file_group_read, queue_group_reads
from batchq.monitoring.stripe_reads import StripeSnapshot, read_stripes, stripe_count
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import MetaField, parse_producer_stat_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import time_ms
from batchq.protocol.ranks import rank_field
from batchq.protocol.words import as_int, as_text
from batchq.wire import codec, refs

__all__ = ["HEADER_PEEK_BYTES", "QueueSnapshot", "RankSnapshot", "read_snapshots"]

#: How much of a frame stored by reference is read to find its header (GETRANGE 0 N-1).
HEADER_PEEK_BYTES = 65536


@dataclass
class RankSnapshot:
    """One rank of a data-parallel trainer (world > 1), read with its queue.

    Attributes:
        rank: the rank.
        depth: LLEN of its data list.
        trainer: its figures (as the queue's trainer hash).
        history: its history samples, newest first.
        claim_deadline_ms: its claim's deadline (0: none).
        done: it finished the run (``close(finished=True)``).
    """

    rank: int
    depth: int
    trainer: dict[str, str]
    history: list[dict[str, Any]]
    claim_deadline_ms: int
    done: bool

    def figure(self, name: str) -> float | None:
        """One of the rank's figures as a float, None if absent or malformed."""
        try:
            return float(self.trainer[name])
        except (KeyError, ValueError):
            return None


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
            (:mod:`batchq.monitoring.stripe_reads`), else empty.
        groups: each group of a run read by several groups (by slot), else empty.
        registry: the run's groups, name -> slot (empty for a run of one group).
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


def _history(raw: list[bytes]) -> list[dict[str, Any]]:
    samples = []
    for item in raw:
        try:
            sample = json.loads(item)
        except ValueError:
            continue
        if isinstance(sample, dict):
            samples.append(sample)
    return samples


def _header_time(buf: bytes | None) -> float | None:
    """The ``t`` of a frame's header, None if absent or unreadable."""
    if not buf:
        return None
    try:
        t = codec.peek_header(buf).get("t")
    except FrameError:
        return None
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def _add_rank(snap: QueueSnapshot, what: str, value: Any) -> None:
    """File one of a rank's three reads (depth first) into ``snap.ranks``."""
    if what == "rank_depth":
        r = len(snap.ranks)
        snap.ranks.append(
            RankSnapshot(
                rank=r,
                depth=int(value),
                trainer={},
                history=[],
                claim_deadline_ms=as_int(
                    snap.meta.get(rank_field(MetaField.CLAIM_DEADLINE, r, snap.world))
                ),
                done=snap.meta.get(rank_field(MetaField.DONE, r, snap.world)) == "1",
            )
        )
    elif what == "rank_trainer":
        snap.ranks[-1].trainer = {as_text(a): as_text(b) for a, b in value.items()}
    else:
        snap.ranks[-1].history = _history(value)


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


_PER_QUEUE = 12  # the reads _queue_reads queues for each queue, in order


def _queue_reads(pipe: Any, k: QueueKeys, history: int) -> None:
    """The first round trip's reads of one queue (see :func:`_from_replies`)."""
    pipe.hgetall(k.meta)
    pipe.llen(k.data)
    pipe.zrange(k.producers, 0, -1, withscores=True)
    pipe.hgetall(k.stats)
    pipe.llen(k.dead)
    pipe.hgetall(k.pstats)
    pipe.hgetall(k.trainer)
    pipe.lrange(k.history, 0, history - 1 if history >= 0 else -1)
    pipe.lindex(k.data, -1)
    pipe.zrange(k.scalers, 0, -1, withscores=True)
    pipe.lindex(k.scalelog, 0)
    pipe.hgetall(k.groups)


def _from_replies(
    k: QueueKeys, now_ms: int, replies: list[Any], history: int
) -> tuple[QueueSnapshot, bytes | None]:
    """One queue's snapshot from its first-round replies, and its oldest element."""
    meta, depth, producers, stats, dead, pstats, trainer, hist, last, scalers, decision = replies[
        :11
    ]
    groups = replies[11]  # the registry of a run read by several groups
    alive = {as_text(p): float(s) for p, s in producers if float(s) >= now_ms}
    snap = QueueSnapshot(
        queue=k.queue,
        now_ms=now_ms,
        meta={as_text(a): as_text(b) for a, b in meta.items()},
        depth=int(depth),
        alive=dict(sorted(alive.items())),
        stats={as_text(a): as_int(b) for a, b in stats.items()},
        dead=int(dead),
        pstats=_pstats(pstats),
        trainer={as_text(a): as_text(b) for a, b in trainer.items()},
        history=_history(hist) if history else [],
        autoscalers=sum(1 for _, score in scalers if float(score) >= now_ms),
        last_decision=next(iter(_history([decision] if decision else [])), None),
        registry={as_text(a): as_text(b) for a, b in groups.items()},
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
    what: list[str] = []
    if snap.registry and as_int(snap.meta.get(MetaField.GROUPS)):
        snap.groups = queue_group_reads(pipe, k, snap.registry, snap.meta, history)
        reads = ["group_depth"] * snap.world + ["group_stats", "group_trainer", "group_history"]
        what += [f"{w}:{i}" for i in range(len(snap.groups)) for w in reads]
    for r in range(snap.world if snap.world > 1 else 0):
        pipe.llen(k.data_of(r, snap.world))
        pipe.hgetall(k.trainer_of(r, snap.world))
        pipe.lrange(k.history_of(r, snap.world), 0, history - 1 if history >= 0 else -1)
        what += ["rank_depth", "rank_trainer", "rank_history"]
    if leases:
        snap.leases = 0
        for p in snap.alive:
            pipe.llen(k.lease(p))
            what.append("lease")
    if last is not None and refs.is_ref(last):
        try:
            ref = refs.decode_ref(last, k.frame_prefix)
        except FrameError:
            return what
        pipe.getrange(ref, 0, HEADER_PEEK_BYTES - 1)
        what.append("ref")
    else:
        snap.oldest_t = _header_time(last)
    return what


def _file_later(snap: QueueSnapshot, what: str, value: Any) -> None:
    """File one second-round reply into its snapshot."""
    if what.startswith("group_"):
        name, i = what.split(":")
        file_group_read(snap.groups[int(i)], name, value, _history)
    elif what.startswith("rank_"):
        _add_rank(snap, what, value)
    elif what == "lease":
        snap.leases = (snap.leases or 0) + int(value)
    else:
        snap.oldest_t = _header_time(value)
