"""Fuel's stream interface for :class:`consumer.stream.ServerDataStream`.

What ``fuel.streams.AbstractDataStream`` and Fuel's own ServerDataStream offer beyond
epoch iterators, so that a Fuel trainer's code and Fuel's trainer-side transformers
(which duck-type their child stream) work unchanged: ``sources``, ``axis_labels``,
``get_data``, ``next_epoch``, ``reset``, and pickling as Fuel's stream pickles (its
connection settings, plus here the position; never a socket, thread or lock).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from batchq.client.connection import call
from batchq.errors import ConfigError
from batchq.protocol.fields import MetaField
from consumer.checkpoint import RUN_KEY
from consumer.reader.prepare import FramePrep, decode_axis_labels
from consumer.stream_options import StreamOptions

__all__ = ["FuelStreamMixin"]


class FuelStreamMixin:
    """Fuel's stream methods over a ServerDataStream's state (mixed into it)."""

    # Provided by ServerDataStream.
    _prep: FramePrep
    _reader: Any
    _client: Any
    options: StreamOptions
    _axis_labels: dict[str, Any] | None
    _data_iter: Iterator[Any] | None
    keys: Any

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources the loop receives, in order (the producers' once seen, if the
        stream was given None)."""
        return self._prep.sources or self._prep.served or ()

    @sources.setter
    def sources(self, value: Sequence[str]) -> None:
        if self._reader is not None:
            raise ConfigError("sources cannot change once the stream has started")
        self._prep.set_sources(value)
        self.options = dataclasses.replace(self.options, sources=self._prep.sources)

    @property
    def axis_labels(self) -> dict[str, Any] | None:
        """Source -> axis names: the constructor's, else those the producers published
        (read once the stream has started; None before, or if they published none)."""
        if self._axis_labels is None and self._client is not None:
            raw = call(lambda: self._client.hget(self.keys.meta, MetaField.AXIS_LABELS), "reading")
            self._axis_labels = decode_axis_labels(raw, self.sources)
        return self._axis_labels

    @axis_labels.setter
    def axis_labels(self, value: Mapping[str, Any] | None) -> None:
        self._axis_labels = None if value is None else dict(value)

    def get_data(self, request: Any = None) -> tuple[Any, ...]:
        """The next batch of the current epoch, as Fuel's ``get_data``.

        At the end of an epoch it raises StopIteration once; the next call begins the
        next epoch.

        Raises:
            ConfigError: ``request`` is not None (the producers choose the requests).
            StopIteration: the epoch ended.
        """
        if request is not None:
            raise ConfigError(f"request {request!r} is not valid: a ServerDataStream takes none")
        if self._data_iter is None:
            self._data_iter = self.get_epoch_iterator()
        try:
            return tuple(next(self._data_iter))
        except StopIteration:
            self._data_iter = None
            raise

    def next_epoch(self) -> None:
        """As Fuel's: nothing to do (the producers plan the epochs; each epoch iterator
        is the next epoch)."""

    def reset(self) -> None:
        """As Fuel's: nothing to do; a get_data epoch in progress is left, though, so that
        the next get_data begins the next epoch."""
        self._data_iter = None

    def __getstate__(self) -> dict[str, Any]:
        # As Fuel's: the connection settings, never a socket, a thread or a lock; plus
        # the position, so that the copy resumes where the original was.
        return {"config": self.options.arguments(), "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(**saved["config"])  # type: ignore[misc]  # a fresh stream
        if saved["state"].get(RUN_KEY):
            self.load_state_dict(saved["state"])
