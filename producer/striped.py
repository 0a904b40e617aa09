"""A producer serving a striped queue: one lane per stripe, served in turn.

A queue of N stripes (:mod:`batchq.protocol.stripes`) is N queues, each in a slot of its
own (on a cluster, on a master of its own). :class:`StripedProducer` holds one
:class:`producer.server.Producer` per stripe (a *lane*: its own client bound to the
stripe's node, membership, heartbeat, leases, pusher and shared-memory segments), all
sharing the stream and its plan, and serves them from one thread: a shard from each
lane in turn, skipping a lane with nothing to lease (its lease window or list is full) and
waiting (bounded, on one lane's wake list, a different one each time) only when none
had any. So one producer process spreads its batches over every stripe, and a producer
killed mid-shard leaves work in every stripe that the others redo, as with one queue.

In a run read by several groups (:mod:`batchq.protocol.groups`) each stripe registers
the groups as it does alone; every group claims stripe 0 first and the others once it
has read the plan (consumer/start.py), so a lane k >= 1 leases only once its stripe has
as many group slots as lane 0 knows (``Producer.step(groups=)``): else its first shards
would be built for the first group to claim it alone, and again for each later one.
That wait is bounded (:data:`GROUPS_WAIT_S`, for a group that died between its claims):
past it the lane serves the groups its stripe has, as a queue with a late group.

A lane whose Redis is unreachable holds the thread in its reconnect loop (bounded by
``reconnect_timeout_s``): the other stripes wait meanwhile.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from batchq.client.connection import tune_malloc
from batchq.errors import RunFinished
from batchq.protocol.layout import default_id
from batchq.protocol.stripes import check_stripes
from producer.producer_options import check_stream
from producer.server import Producer
from producer.serving.sharding import ShardPlan

__all__ = ["GROUPS_WAIT_S", "StripedProducer"]

log = logging.getLogger(__name__)

# How long a lane k >= 1 waits for the groups of stripe 0 to claim its stripe.
GROUPS_WAIT_S = 10.0


class StripedProducer:
    """Serves one stream into the N stripes of a queue.

    Args:
        stream: a DataStream or transformer chain (Fuel's API).
        url: the Redis URL (a cluster's puts the stripes on its masters).
        queue: the queue's name.
        hwm: each stripe's cap (the run's hwm).
        stripes: N, fixed when the run is created (a producer with another N is
            refused with PipelineMismatch).
        **options: :class:`producer.server.Producer`'s (window, producer_id, ...,
            ``shard_plan``: the plan, made already); the lanes share one producer id
            and one plan.
    """

    def __init__(
        self, stream: Any, url: str, queue: str = "default", hwm: int = 10, *, stripes: int,
        **options: Any,
    ) -> None:  # fmt: skip
        check_stream(stream)
        count = check_stripes(stripes)
        options.setdefault("producer_id", default_id())
        # The lanes' job started here, before the plan's probe batch (as a Producer's).
        options.setdefault("job_started_s", time.time())
        plan = options.pop("shard_plan", None) or ShardPlan(
            stream, options.pop("requests_per_shard", None)
        )
        options.pop("requests_per_shard", None)  # the plan given has its own
        self.lanes = [
            Producer(stream, url, queue, hwm, stripe=(k, count), shard_plan=plan, **options)
            for k in range(count)
        ]
        self.id = self.lanes[0].id
        for k, lane in enumerate(self.lanes):
            # One thread serves every lane: a push waiting at one stripe's full list
            # must not hold it while another stripe's trainer waits (a run the ranks
            # restarted waits for its plan, which only this thread's next lane publishes).
            lane.watch_others(functools.partial(self._others_starved, k))
        self._turn = 0  # the lane served first in the next round
        # Lane k >= 1 waiting for stripe 0's groups: since when, and the counts waived.
        self._held_since: dict[int, float] = {}
        self._waived: dict[int, int] = {}

    @property
    def stopped(self) -> bool:
        """Whether serving stops (asked to, a lane orphaned, or the run finished)."""
        return any(lane.stopped for lane in self.lanes)

    @property
    def orphaned(self) -> bool:
        """Whether serving stopped because no trainer claimed the run (orphan_exit_s)."""
        return any(lane.orphaned for lane in self.lanes)

    def stop(self) -> None:
        """Ask every lane to stop after its current step (thread- and signal-safe)."""
        for lane in self.lanes:
            lane.stop()

    def serve(self) -> int:
        """Serve until the run finishes (returns 0) or :meth:`stop` is called (returns 0).

        Raises:
            PipelineMismatch: the run was created by another pipeline, hwm or stripes.
            ConnectionLost: a stripe's Redis could not be reached.
        """
        tune_malloc()
        started: list[Producer] = []
        finished = False
        try:
            for lane in self.lanes:
                started.append(lane)
                lane.begin()
            while not self.stopped:
                self._round()
        except RunFinished as e:
            log.info("producer %s: %s", self.id, e)
            finished = True
        finally:
            for lane in started:
                lane.end(finished)
        return 0

    def _round(self) -> None:
        """A shard from each lane that has one to lease; a bounded wait if none had."""
        count = len(self.lanes)
        served = False
        for i in range(count):
            if self.stopped:
                return
            k = (self._turn + i) % count
            groups = self._groups_for(k)
            served = self.lanes[k].step(wait=False, groups=groups) or served
            if groups and self.lanes[k].groups >= groups:
                self._held_since.pop(k, None)
        self._turn = (self._turn + 1) % count
        if not served and not self.stopped:
            self.lanes[self._turn].wait_for_room()

    def _others_starved(self, k: int) -> bool:
        """Whether a lane other than ``k`` has an empty list (its trainer may wait)."""
        return any(lane.list_empty() for j, lane in enumerate(self.lanes) if j != k)

    def _groups_for(self, k: int) -> int:
        """The group slots lane ``k`` waits for before it leases (0: none): stripe 0's,
        until :data:`GROUPS_WAIT_S` has passed for that count."""
        want = self.lanes[0].groups
        if k == 0 or want <= self.lanes[k].groups or self._waived.get(k) == want:
            return 0
        since = self._held_since.setdefault(k, time.monotonic())
        if time.monotonic() - since < GROUPS_WAIT_S:
            return want
        log.warning(
            "producer %s: stripe %d has fewer groups than stripe 0's %d after %g s; "
            "serving those it has", self.id, k, want, GROUPS_WAIT_S,
        )  # fmt: skip
        self._waived[k] = want
        self._held_since.pop(k, None)
        return 0
