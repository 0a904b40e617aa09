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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from batchq.protocol.params_log import EMPTY_PARAMS, ParamsLog

__all__ = ["Building", "batch_index", "building", "params", "params_log", "params_version"]


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
