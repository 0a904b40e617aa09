"""Transformers that group, split, pad, cache or merge items (Fuel's Batch, Unpack, ...).

They consume several child items per item they yield (or several children), so a
sharding plan cannot cut their epochs between arbitrary requests of the root stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from producer.config import floatx
from producer.errors import (
    ConfigError,
    IncompleteBatchError,
    InvalidRequestError,
    SchemeError,
    ShapeError,
    SourceError,
    StreamMismatchError,
)
from producer.randomness import RandomStateMixin
from producer.schemes import BatchSizeScheme
from producer.streams import AbstractDataStream
from producer.transformers.base import Transformer, check_sources, stack_examples

__all__ = ["Batch", "Cache", "Merge", "Padding", "Unpack"]

log = logging.getLogger(__name__)


def _need_int_request(name: str, request: Any) -> int:
    if request is None:
        raise InvalidRequestError(f"{name} needs a batch-size request from its scheme, got None")
    return int(request)


class Batch(Transformer):
    """Groups the examples of a stream into batches.

    Args:
        data_stream: a stream of examples.
        iteration_scheme: a scheme of batch sizes, e.g.
            :class:`~producer.schemes.ConstantScheme`.
        strictness: what to do with a last batch smaller than requested: 0 yields it,
            1 drops it, 2 raises :class:`~producer.errors.IncompleteBatchError`.
        **kwargs: ``axis_labels``.

    Raises:
        StreamMismatchError: ``data_stream`` gives batches, or the scheme requests
            examples.
        ConfigError: ``strictness`` is not 0, 1 or 2.
    """

    def __init__(
        self, data_stream: Any, iteration_scheme: Any, strictness: int = 0, **kwargs: Any
    ) -> None:
        if not data_stream.produces_examples:
            raise StreamMismatchError(
                "Batch: the wrapped data stream must produce examples, not batches of examples"
            )
        if iteration_scheme.requests_examples:
            raise StreamMismatchError(
                f"Batch: the iteration scheme {type(iteration_scheme).__name__} requests "
                "single examples; it must request batches (e.g. ConstantScheme)"
            )
        if strictness not in (0, 1, 2):
            raise ConfigError(f"strictness={strictness!r} is not valid: expected 0, 1 or 2")
        if data_stream.axis_labels:
            kwargs.setdefault(
                "axis_labels",
                {
                    s: ("batch", *labels) if labels else None
                    for s, labels in data_stream.axis_labels.items()
                },
            )
        super().__init__(data_stream, iteration_scheme=iteration_scheme, **kwargs)
        self.strictness = strictness

    def get_data(self, request: Any = None) -> tuple[np.ndarray, ...]:
        """Read ``request`` examples and stack them, one array per source."""
        size = _need_int_request("Batch", request)
        data: list[list[Any]] = [[] for _ in self.sources]
        for _ in range(size):
            try:
                example = self._next_child()
            except StopIteration:
                if self._short_batch(len(data[0]) if data else 0, size):
                    break
                raise
            for column, value in zip(data, example, strict=True):
                column.append(value)
        return tuple(stack_examples(column) for column in data)

    def _short_batch(self, got: int, size: int) -> bool:
        """The epoch ended after ``got`` of ``size`` examples: whether to yield them
        (strictness 0); strictness 2 raises; otherwise (1, or none) the epoch ends."""
        if got and self.strictness == 2:
            raise IncompleteBatchError(
                f"Batch(strictness=2): the epoch ended after {got} of the {size} "
                "examples of the last batch"
            ) from None
        return bool(got) and self.strictness == 0


class Unpack(Transformer):
    """Splits the batches of a stream into examples (the inverse of :class:`Batch`).

    Args:
        data_stream: a stream of batches.
        **kwargs: ``axis_labels``.

    Raises:
        StreamMismatchError: ``data_stream`` gives examples.
    """

    def __init__(self, data_stream: Any, **kwargs: Any) -> None:
        if data_stream.produces_examples:
            raise StreamMismatchError(
                "Unpack: the wrapped data stream must produce batches of examples, not examples"
            )
        if data_stream.axis_labels:
            kwargs.setdefault(
                "axis_labels",
                {
                    s: labels[1:] if labels else None
                    for s, labels in data_stream.axis_labels.items()
                },
            )
        super().__init__(data_stream, produces_examples=True, **kwargs)
        self.data: Iterator[tuple[Any, ...]] | None = None

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Start an epoch; examples left from the previous one are dropped."""
        self.data = None
        return super().get_epoch_iterator(as_dict=as_dict)

    def get_data(self, request: Any = None) -> tuple[Any, ...]:
        """The next example of the current batch (reading the next batch when needed)."""
        if request is not None:
            raise InvalidRequestError(f"Unpack takes no request, got {request!r}")
        while True:
            if self.data is None:
                self.data = zip(*self._next_child(), strict=True)
            try:
                return next(self.data)
            except StopIteration:
                self.data = None


class Padding(Transformer):
    """Pads the variable-length sequences of a batch with zeros and adds masks.

    For each masked source ``s`` a source ``s_mask`` follows it: 1 where the batch has
    data, 0 where it has padding. All axes but the first (the length) must agree.

    Args:
        data_stream: a stream of batches.
        mask_sources: the sources to pad and mask (default: all).
        mask_dtype: the masks' dtype (default: the configured floatX, see
            :mod:`producer.config`).
        **kwargs: ``axis_labels``.

    Raises:
        StreamMismatchError: ``data_stream`` gives examples.
        SourceError: a mask source is not a source of ``data_stream``.
    """

    def __init__(
        self,
        data_stream: Any,
        mask_sources: Sequence[str] | None = None,
        mask_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        if data_stream.produces_examples:
            raise StreamMismatchError(
                "Padding: the wrapped data stream must produce batches of examples, not examples"
            )
        super().__init__(data_stream, produces_examples=False, **kwargs)
        if mask_sources is None:
            mask_sources = tuple(data_stream.sources)
        self.mask_sources = check_sources(
            "Padding(mask_sources=...)", mask_sources, data_stream.sources
        )
        self.mask_dtype = np.dtype(floatx() if mask_dtype in (None, "floatX") else mask_dtype)

    @property
    def sources(self) -> tuple[str, ...]:
        """Each source of the wrapped stream, followed by its mask if it is masked."""
        sources: list[str] = []
        for source in self.data_stream.sources:
            sources.append(source)
            if source in self.mask_sources:
                sources.append(source + "_mask")
        return tuple(sources)

    @sources.setter
    def sources(self, value: Sequence[str]) -> None:
        raise ConfigError("the sources of a Padding are set by its mask_sources argument")

    def transform_batch(self, batch: Sequence[Any]) -> tuple[Any, ...]:
        """Pad the masked sources and insert their masks."""
        out: list[Any] = []
        for source, source_batch in zip(self.data_stream.sources, batch, strict=True):
            if source not in self.mask_sources:
                out.append(source_batch)
                continue
            padded, mask = self._pad(source, [np.asarray(x) for x in source_batch])
            out.extend((padded, mask))
        return tuple(out)

    def _pad(self, source: str, samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        rest = _common_shape(source, samples)
        lengths = [s.shape[0] for s in samples]
        longest = max(lengths, default=0)
        padded = np.zeros((len(samples), longest, *rest), dtype=_padded_dtype(samples))
        mask = np.zeros((len(samples), longest), dtype=self.mask_dtype)
        for i, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            padded[i, :length] = sample
            mask[i, :length] = 1
        return padded, mask


def _common_shape(source: str, samples: list[np.ndarray]) -> tuple[int, ...]:
    """The dimensions after the length, which every sample of ``source`` must share."""
    if any(s.ndim == 0 for s in samples):
        raise ShapeError(f"Padding: source {source!r} has scalar examples, not sequences")
    shapes = [s.shape for s in samples]
    rest = shapes[0][1:] if shapes else ()
    if any(shape[1:] != rest for shape in shapes):
        raise ShapeError(
            f"Padding: all dimensions except length must be equal in source {source!r}; "
            f"got shapes {shapes}"
        )
    return rest


def _padded_dtype(samples: list[np.ndarray]) -> Any:
    """What the non-empty samples' dtypes promote to (the first's, or float, if none)."""
    non_empty = [s.dtype for s in samples if s.size]
    if non_empty:
        return np.result_type(*non_empty)
    return samples[0].dtype if samples else float


class Cache(Transformer):
    """Re-cuts a stream of (large) batches into batches of the sizes a scheme asks for.

    Args:
        data_stream: a stream of batches.
        iteration_scheme: a :class:`~producer.schemes.BatchSizeScheme`.
        **kwargs: ``axis_labels``.

    Attributes:
        cache: one list per source of the examples read and not yet returned; emptied
            at the start of each epoch.

    Raises:
        SchemeError: the scheme is not a BatchSizeScheme.
    """

    def __init__(self, data_stream: Any, iteration_scheme: Any, **kwargs: Any) -> None:
        if not isinstance(iteration_scheme, BatchSizeScheme):
            raise SchemeError(
                f"Cache: the iteration scheme must be a BatchSizeScheme (e.g. ConstantScheme), "
                f"got {type(iteration_scheme).__name__}"
            )
        if data_stream.axis_labels:
            kwargs.setdefault("axis_labels", dict(data_stream.axis_labels))
        super().__init__(data_stream, iteration_scheme=iteration_scheme, **kwargs)
        self.cache: list[list[Any]] = [[] for _ in self.sources]

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Start an epoch with an empty cache."""
        self.cache = [[] for _ in self.sources]
        return super().get_epoch_iterator(as_dict=as_dict)

    def get_data(self, request: Any = None) -> tuple[np.ndarray, ...]:
        """Return ``request`` examples, reading child batches while the cache is short.

        The last batch of an epoch may be smaller; an empty cache ends the epoch.
        """
        size = _need_int_request("Cache", request)
        while len(self.cache[0]) < size:
            try:
                batch = self._next_child()
            except StopIteration:
                if not self.cache[0]:
                    raise
                break
            for cache, values in zip(self.cache, batch, strict=True):
                cache.extend(values)
        data = []
        for i, cache in enumerate(self.cache):
            data.append(stack_examples(cache[:size]))
            self.cache[i] = cache[size:]
        return tuple(data)


def _mark_branch(stream: Any, branch: int) -> None:
    """Tell the random components below ``stream`` which Merge input they are under."""
    stack = [stream]
    while stack:
        node = stack.pop()
        if isinstance(node, RandomStateMixin):
            node.under_branch(branch)
        children = getattr(node, "data_streams", None)
        if children:
            stack.extend(children)
        elif getattr(node, "data_stream", None) is not None:
            stack.append(node.data_stream)


class Merge(AbstractDataStream):
    """Zips several streams into one: each item concatenates one item of each.

    The epoch ends when the shortest stream ends.

    Args:
        data_streams: the streams, all of examples or all of batches.
        sources: the names of the merged sources, as many as the streams have in all.
        axis_labels: the merged stream's axis labels.

    Attributes:
        data_streams: the merged streams (a sharding plan walks these).

    Raises:
        StreamMismatchError: the streams mix examples and batches.
        SourceError: ``sources`` has the wrong length or repeats a name.
    """

    def __init__(
        self,
        data_streams: Sequence[Any],
        sources: Sequence[str],
        axis_labels: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(iteration_scheme=None, axis_labels=axis_labels)
        self.data_streams = list(data_streams)
        if not self.data_streams:
            raise ConfigError("Merge needs at least one data stream")
        kinds = [bool(s.produces_examples) for s in self.data_streams]
        if len(set(kinds)) != 1:
            raise StreamMismatchError(
                "Merge: all data streams must produce the same type of output (examples or "
                f"batches); produces_examples: {kinds}"
            )
        self.produces_examples = kinds[0]
        child_sources = [name for s in self.data_streams for name in s.sources]
        sources = (sources,) if isinstance(sources, str) else tuple(sources)
        if len(sources) != len(child_sources) or len(set(sources)) != len(sources):
            raise SourceError(
                f"Merge: sources={list(sources)} must name each of the {len(child_sources)} "
                f"merged sources {child_sources} once"
            )
        self.sources = sources
        self.child_epoch_iterators: list[Iterator[Any]] = []
        for branch, stream in enumerate(self.data_streams):
            _mark_branch(stream, branch)

    def close(self) -> None:
        """Close every merged stream."""
        for stream in self.data_streams:
            stream.close()

    def reset(self) -> None:
        """Reset every merged stream."""
        for stream in self.data_streams:
            stream.reset()

    def next_epoch(self) -> None:
        """Move every merged stream to its next epoch."""
        for stream in self.data_streams:
            stream.next_epoch()

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Start a new epoch of every merged stream."""
        self.child_epoch_iterators = [s.get_epoch_iterator() for s in self.data_streams]
        return super().get_epoch_iterator(as_dict=as_dict)

    def get_data(self, request: Any = None) -> tuple[Any, ...]:
        """One item of each stream, concatenated."""
        if request is not None:
            raise InvalidRequestError(f"Merge takes no request, got {request!r}")
        result: list[Any] = []
        for iterator in self.child_epoch_iterators:
            result.extend(next(iterator))
        return tuple(result)
