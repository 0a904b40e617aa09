"""A producer's membership of its queue's run: joining, the run it serves, and leaving.

:meth:`Membership.join` runs join.lua (which creates the queue and run where there is
none, checks the pipeline's fingerprint and cap, hands this producer's stale leases back
and beats once) and turns its reply into the :class:`RunPosition` served, or into the
error that ends serving: the run finished after this producer's job started (a late
replica of a finished job: ``RunFinished``; a run finished before it started was an
earlier job's, and the join starts the queue's next run), another pipeline or cap
(``PipelineMismatch``). After Redis lost
the queue's state, a producer that had joined before waits (bounded, ``orphan_wait_s``)
for the trainer to re-create the run from its ledger instead of creating a fresh run
that would re-plan from scratch. :meth:`Membership.leave` hands the producer's leases
back. What the Producer does around both (its pusher, heartbeat and transport follow
the new position) is the Producer's (:mod:`producer.server`).

**The run served** is one value, replaced whole at each join: the producer's join (on
its serving thread) makes a new :class:`RunPosition` and hands it to its pushers
(:meth:`producer.serving.pushing.ShardPusher.joined`), its transport
(:meth:`producer.serving.transport.Transport.joined`) and its heartbeat thread
(:meth:`producer.serving.heartbeat.Heartbeat.follow`, under the heartbeat's lock).
Nobody changes a position in place, so whoever reads one sees the run, incarnation and
world of one join; a run that more groups joined since gives a new position with the
same run and more ``groups`` (``Producer._regroup``). The position also carries the
run's cap on each data list, ``list_cap`` (Fuel's ``hwm`` argument): the producer's
first position holds the cap it was given, each join asks join.lua for it (which
refuses a run with another) and passes it on to the next position, and the transport
sizes its pool by it. It is held nowhere else.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from batchq.client.connection import StopEvent, call
from batchq.errors import BatchQueueError, PipelineMismatch, RunFinished
from batchq.protocol import producer_scripts, recovery_scripts
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import MAX_GROUPS, new_run_id
from batchq.protocol.producer_scripts import JoinReply
from batchq.protocol.reaper import record_client
from batchq.protocol.words import PROTOCOL_VERSION, Status, as_int, status_error
from producer.serving.sharding import ShardPlan

__all__ = ["JOIN_POLL_S", "Membership", "RunPosition", "axis_labels_json"]

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.25  # how often a producer waiting for a lost run's trainer asks again


@dataclass(frozen=True)
class RunPosition:
    """The run a producer serves ('' before its first join)."""

    run: str = ""
    incarnation: str = ""
    world: int = 1  # ranks of the run's trainer (batchq/protocol/ranks.py)
    groups: int = 0  # group slots of a run read by several groups (batchq/protocol/groups.py)
    # Each group slot's ranks (slot 0's is ``world``): each group reads with its own.
    worlds: tuple[int, ...] = ()
    # The most elements each data list holds (the hwm); 1 where none was given.
    list_cap: int = 1

    def world_of(self, slot: int) -> int:
        """The ranks group slot ``slot`` reads with."""
        return self.worlds[slot] if 0 < slot < len(self.worlds) else self.world

    def slot_worlds(self) -> tuple[int, ...]:
        """Each group slot's ranks, slot 0 first (one slot in a run of one group)."""
        return tuple(self.world_of(i) for i in range(max(self.groups, 1)))


class Membership:
    """One producer's joins and leave of one queue.

    Args:
        client: the producer's client.
        keys: the queue's keys.
        producer: the producer's id.
        plan: the producer's shard plan (fingerprint, S, batches per epoch).
        lease_window: how far past the trainer's oldest incomplete shard the run
            mints shards (join.lua's ``window``).
        heartbeat_ttl_ms: the producer's heartbeat TTL.
        orphan_wait_s: after Redis lost the queue's state, how long to wait for the
            trainer to re-create the run.
        axis_labels: the stream's axis labels as :func:`axis_labels_json` gives them.
        stop: the producer's stop event (ends a wait).
        stripes: the queues the run is striped over (:mod:`batchq.protocol.stripes`).
        started_s: when this producer's job started (wall clock, s): its process, or
            the pool's fork of it (None: now). Each join sends its age, not the time
            itself, so this host's clock and Redis' need not agree.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        producer: str,
        plan: ShardPlan,
        *,
        lease_window: int,
        heartbeat_ttl_ms: int,
        orphan_wait_s: float,
        axis_labels: str | None,
        stop: StopEvent,
        stripes: int = 1,
        started_s: float | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.id = producer
        self.plan = plan
        self.lease_window = lease_window
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.orphan_wait_s = orphan_wait_s
        self.axis_labels = axis_labels
        self._stop = stop
        self.stripes = stripes
        self.started_s = time.time() if started_s is None else started_s
        self._record_id = True  # False once the server refused CLIENT ID (ACL)

    def join(self, served: RunPosition) -> RunPosition | None:
        """Join (again) after serving ``served`` ('' the first time), asking for its
        ``list_cap``: the position to serve (with the same cap), or None if the producer
        was stopped while waiting.

        Raises:
            RunFinished: the run finished after this producer's job started.
            PipelineMismatch: the run was created by another pipeline or cap.
            BatchQueueError: another refusal (:func:`batchq.protocol.words.status_error`).
        """
        reply = self._reply(served)
        if reply is None:
            return None
        self._check(reply, served.list_cap)
        self._publish()
        log.info(
            "producer %s joined queue %s (run %s, S=%d, hwm=%s)",
            self.id,
            self.keys.queue,
            reply.run,
            self.plan.shards,
            reply.hwm,
        )
        worlds = self.groups()[1] if reply.groups else ()
        return RunPosition(
            reply.run, reply.incarnation, reply.world, reply.groups, worlds, served.list_cap
        )

    def groups(self) -> tuple[int, tuple[int, ...]]:
        """The group slots of the run (0: read by one group) and each slot's ranks, read
        together: its leases and pushes then name every slot's keys
        (batchq.protocol.groups; a slot keeps its world while the run has it)."""
        fields = [MetaField.GROUPS, *(reader_field(MetaField.WORLD, i) for i in range(MAX_GROUPS))]
        values = call(lambda: self.client.hmget(self.keys.meta, fields), "reading meta")
        groups = as_int(values[0])
        return groups, tuple(as_int(w) or 1 for w in values[1 : max(groups, 1) + 1])

    def _reply(self, served: RunPosition) -> JoinReply | None:
        """join.lua's first reply that is not WAIT (a producer that had joined before
        waits up to orphan_wait_s for a lost run's trainer); None once stopped."""
        deadline = time.monotonic() + (self.orphan_wait_s if served.incarnation else 0.0)
        while True:
            reply = self._join_once(served.list_cap, no_create=time.monotonic() < deadline)
            if reply.status != Status.WAIT:
                return reply
            if self._stop.wait(JOIN_POLL_S):
                return None

    def _join_once(self, list_cap: int, *, no_create: bool) -> JoinReply:
        return producer_scripts.join(
            self.client,
            self.keys,
            producer=self.id,
            fingerprint=self.plan.fingerprint,
            hwm=list_cap,
            shards=self.plan.shards,
            window=self.lease_window,
            new_run=new_run_id(),
            new_incarnation=uuid.uuid4().hex,
            heartbeat_ttl_ms=self.heartbeat_ttl_ms,
            version=PROTOCOL_VERSION,
            epoch_batches=self.plan.epoch_batches,
            age_ms=max(0, int(1000 * (time.time() - self.started_s))),
            no_create=no_create,
            shard_batches=self.plan.shard_batches,
            stripes=self.stripes,
        )

    def _check(self, reply: JoinReply, list_cap: int) -> None:
        """Raise what a refused join means (``list_cap``: the cap asked for)."""
        if reply.status == Status.FINISHED:
            raise RunFinished(
                f"queue {self.keys.queue}: the run finished after this producer started"
            )
        if reply.status == Status.MISMATCH:
            got = {
                "fingerprint": self.plan.fingerprint,
                "stripes": str(self.stripes),
                "version": PROTOCOL_VERSION,
            }.get(reply.what, str(list_cap))
            raise PipelineMismatch(reply.what, reply.expected, got)
        if reply.status != Status.OK:
            raise status_error(reply.status, f"producer {self.id} joining")

    def _publish(self) -> None:
        """After a join: the connection's CLIENT ID (Redis tells a killed producer by
        its closed connection: batchq.protocol.reaper) and the axis labels."""
        if self._record_id:
            self._record_id = record_client(self.client, self.keys, self.id)
        if self.axis_labels is None:
            return
        try:  # a convenience for the trainer (ServerDataStream.axis_labels): best effort
            self.client.hset(self.keys.meta, MetaField.AXIS_LABELS, self.axis_labels)
        except redis.RedisError as e:
            log.debug("producer %s: axis labels not published: %s", self.id, e)

    def leave(self, incarnation: str, pending_ref: str | None) -> None:
        """Hand every lease back and forget the recorded connections (reap.lua, why
        'leave'), delete a frame stored by reference and never listed; logs what fails."""
        if not incarnation and not pending_ref:
            return  # never joined (Redis never answered): nothing to hand back
        try:
            if pending_ref:
                self.client.delete(pending_ref)
            recovery_scripts.reap(
                self.client, self.keys, incarnation=incarnation, why="leave", producers=[self.id]
            )
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("producer %s: could not hand back its leases: %s", self.id, e)


def axis_labels_json(stream: Any) -> str | None:
    """The stream's axis labels as the trainer reads them from meta: JSON source ->
    list of axis names (or null), or None when the stream has none."""
    labels = getattr(stream, "axis_labels", None)
    if not labels:
        return None
    return json.dumps(
        {str(s): None if v is None else [str(a) for a in v] for s, v in dict(labels).items()}
    )
