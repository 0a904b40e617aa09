"""The run's params log as one producer knows it, and the params of each batch it builds.

Every lease carries the params log's stamp (meta ``params``, ``'<run>:<version>'``,
lease.lua): :meth:`ProducerParams.follow` reads the whole log again (one bounded read)
only when the stamp changed, so the hot path pays one field of a reply it already gets.
:class:`ShardParams` sets the params of each batch of a shard around its build
(:func:`producer.control.building`) and remembers the version each batch got, which its
frame carries: a batch built ahead of a change says so, and the trainer drops it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import redis

from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES
from batchq.protocol.params_log import ParamsLog
from batchq.protocol.ranks import frame_index
from producer import control

__all__ = ["ProducerParams", "ShardParams"]

log = logging.getLogger(__name__)


class ProducerParams:
    """The run's params log as this producer last read it.

    Args:
        keys: the queue's keys.
        stride: the plan's batches per full shard (None: it cannot count them).
    """

    def __init__(self, keys: QueueKeys, stride: int | None) -> None:
        self.keys = keys
        self.stride = stride or 0
        self.log = ParamsLog()
        self.stamp = ""  # the stamp of the log held ('': none read)
        self.run = ""

    def joined(self, run: str) -> None:
        """The producer joined ``run``: another run's log is not this one's."""
        if run != self.run:
            self.run, self.log, self.stamp = run, ParamsLog(), ""

    def current(self, stamp: str) -> bool:
        """Whether the log held is the one ``stamp`` names."""
        return stamp == self.stamp

    def follow(self, client: redis.Redis, stamp: str) -> None:
        """Read the log again if ``stamp`` (a lease's) names another than the one held.

        A log that is not batchq's is logged and taken as empty (its frames then carry
        version 0, which the trainer drops and has built again: nothing is lost).
        """
        if stamp == self.stamp:
            return
        raw = client.getrange(self.keys.params, 0, PARAMS_LOG_MAX_BYTES + 64)
        try:
            self.log = ParamsLog.from_stored(raw, self.run)
        except ConfigError as e:
            log.warning("queue %s: %s; serving without params", self.keys.queue, e)
            self.log = ParamsLog()
        self.stamp = stamp

    def shard(self, g: int) -> ShardParams:
        """The params of the batches of global slot ``g``."""
        return ShardParams(self, g)


class ShardParams:
    """The params of one shard's batches, set around each batch's build.

    Args:
        source: the producer's log (read at each batch: a shard built after the log
            changed gets the new one from that batch on).
        g: the shard's global slot number.
    """

    def __init__(self, source: ProducerParams, g: int) -> None:
        self.source = source
        self.g = g
        self.versions: dict[int, int] = {}

    def index(self, k: int) -> int:
        """The global index of the shard's batch ``k`` (of its END or ERROR frame at
        ``k``: :func:`batchq.protocol.ranks.frame_index`)."""
        return frame_index(self.g, k, self.source.stride)

    @contextlib.contextmanager
    def around(self, k: int) -> Iterator[None]:
        """The context of building batch ``k`` (its version is remembered)."""
        with control.building(self.source.log, self.index(k)) as state:
            self.versions[k] = state.version
            yield

    def version(self, k: int) -> int:
        """The version batch ``k`` was built with (the log's at its index if it was not
        built here: an END or ERROR frame's)."""
        found = self.versions.get(k)
        return self.source.log.version_at(self.index(k)) if found is None else found
