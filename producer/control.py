"""What the trainer steers: the params in effect for the batch being built.

The trainer changes the producers' parameters with ``ServerDataStream.set_params``; the
run records each change in its change log (:mod:`batchq.protocol.params_log`) with the
global batch index from which it applies. While a producer builds a batch, the serving
code sets the params in effect at that batch's index here (:func:`building`, around
each batch, so a shard that spans a change gets the right params for each batch), and
any dataset, scheme, transformer or torch ``Dataset.__getitem__`` reads them::

    from producer import control

    class Augment(Transformer):
        def transform_batch(self, batch):
            strength = control.params().get("strength", 0.0)
            ...

Outside a served batch (in-process, before any change) :func:`params` is empty. The
values are read-only (mappings as ``MappingProxyType``, lists as tuples): a pipeline
cannot change the run's params, only the trainer can. A mixture
(:class:`producer.mixture.Mixture`) also needs the whole log (:func:`params_log`: the
params at the indices of earlier batches) and the index of the batch being built
(:func:`batch_index`).

The state is a :class:`contextvars.ContextVar`: each thread (and each asyncio task) sees
its own, so two producers in threads of one process never see each other's.

**Where the serving code gets them.** Every lease carries the params log's stamp (meta
``params``, ``'<run>:<version>'``, lease.lua): :meth:`ProducerParams.follow` reads the
whole log again (one bounded read) only when the stamp changed, so the hot path pays one
field of a reply it already gets. :class:`ShardParams` sets the params of each batch of
a shard around its build (:func:`building`) and remembers the version each batch got,
which its frame carries: a batch built ahead of a change says so, and the trainer drops
it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES
from batchq.protocol.params_log import EMPTY_PARAMS, ParamsLog
from batchq.protocol.ranks import frame_index

__all__ = [
    "Building",
    "ProducerParams",
    "ShardParams",
    "batch_index",
    "building",
    "params",
    "params_log",
    "params_version",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Building:
    """The batch being built: its global index, the run's params log as the producer
    knows it, and what the log says at that index.

    Attributes:
        index: the batch's global index (:class:`batchq.protocol.ranks.BatchNumbering`).
        log: the run's change log.
        version: the log's version in effect at ``index`` (the frame carries it).
        params: the params in effect at ``index`` (read-only).
    """

    index: int
    log: ParamsLog
    version: int
    params: Mapping[str, Any]


_EMPTY_LOG = ParamsLog()
_current: contextvars.ContextVar[Building | None] = contextvars.ContextVar(
    "batchq_building", default=None
)


@contextlib.contextmanager
def building(log: ParamsLog, index: int) -> Iterator[Building]:
    """Set the batch being built (global index ``index``, the run's ``log``) for the
    duration of the ``with``: what the serving code wraps around each batch's build."""
    version, values = log.at(index)
    state = Building(index, log, version, values)
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)


def params() -> Mapping[str, Any]:
    """The params in effect for the batch being built (read-only; empty before any
    change, and outside a served batch)."""
    state = _current.get()
    return EMPTY_PARAMS if state is None else state.params


def params_version() -> int:
    """The params log's version in effect for the batch being built (0: none)."""
    state = _current.get()
    return 0 if state is None else state.version


def params_log() -> ParamsLog:
    """The run's whole change log as the producer knows it (empty in-process)."""
    state = _current.get()
    return _EMPTY_LOG if state is None else state.log


def batch_index() -> int | None:
    """The global index of the batch being built (None outside a served batch)."""
    state = _current.get()
    return None if state is None else state.index


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
        with building(self.source.log, self.index(k)) as state:
            self.versions[k] = state.version
            yield

    def version(self, k: int) -> int:
        """The version batch ``k`` was built with (the log's at its index if it was not
        built here: an END or ERROR frame's)."""
        found = self.versions.get(k)
        return self.source.log.version_at(self.index(k)) if found is None else found
