"""The iterator over one epoch of a stream (Fuel's ``fuel.iterator.DataIterator``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

__all__ = ["DataIterator"]

log = logging.getLogger(__name__)


class _Stream(Protocol):
    sources: tuple[str, ...]

    def get_data(self, request: Any = None) -> Any: ...


class DataIterator(Iterator[Any]):
    """An iterator over the data of one epoch.

    Each ``next()`` takes the next request (if there is a request iterator) and
    returns ``data_stream.get_data(request)``; the epoch ends when the requests run
    out or when ``get_data`` raises ``StopIteration``.

    Args:
        data_stream: the stream to read (a DataStream or a transformer).
        request_iterator: the requests of the epoch (any iterable: a list is fine), or
            None to call ``get_data()`` with no request.
        as_dict: return ``{source: value}`` dicts instead of tuples in source order.
    """

    def __init__(
        self,
        data_stream: _Stream,
        request_iterator: Iterable[Any] | None = None,
        as_dict: bool = False,
    ) -> None:
        self.data_stream = data_stream
        # iter() so that a scheme may return a list (as the sharding plan does).
        self.request_iterator = None if request_iterator is None else iter(request_iterator)
        self.as_dict = as_dict

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> Any:
        if self.request_iterator is not None:
            data = self.data_stream.get_data(next(self.request_iterator))
        else:
            data = self.data_stream.get_data()
        if self.as_dict:
            return dict(zip(self.data_stream.sources, data, strict=False))
        # Tuples everywhere, even when a transformer returned a list.
        return tuple(data) if isinstance(data, list) else data
