"""Data streams: a dataset (or another stream) read epoch by epoch (``fuel.streams``).

Sharding contract: :meth:`DataStream.get_epoch_iterator` reads ``self.iteration_scheme``
when it is called and calls ``self.iteration_scheme.get_request_iterator()`` with no
argument, right away. A sharding plan may therefore swap the root stream's scheme for
an object whose ``get_request_iterator()`` returns a fixed list of requests, for the
duration of that call only. Such an object need not have ``requests_examples``: the
stream then keeps the kind (examples or batches) it had when it was built.

A :class:`DataStream` whose scheme requests example indices of an indexable dataset
takes ``on_sample_error='quarantine'``: an example whose read raises is recorded and
replaced by a substitute (:mod:`producer.datasets.sample_errors`, on
:mod:`producer.quarantine`'s rule, records and cap, as a torch dataset's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from producer.datasets.sample_errors import IndexedReads
from producer.errors import ConfigError, StreamError
from producer.iterator import DataIterator
from producer.quarantine import DEFAULT_MAX_QUARANTINED, SampleErrors, check_sample_errors

__all__ = ["AbstractDataStream", "DataIterator", "DataStream"]

log = logging.getLogger(__name__)


class AbstractDataStream:
    """A stream of data separated into epochs.

    Args:
        iteration_scheme: the scheme whose requests drive each epoch, or None.
        axis_labels: maps source names to tuples naming each axis, or None.

    Attributes:
        iteration_scheme: as given; may be replaced between epochs.
        axis_labels: as given.
        sources: the names of the sources, in the order data tuples use.
        produces_examples: True for a stream of single examples, False for batches.
    """

    def __init__(self, iteration_scheme: Any = None, axis_labels: dict[str, Any] | None = None):
        self.iteration_scheme = iteration_scheme
        self.axis_labels = axis_labels
        # The kind the scheme gave at construction: the fallback when a replacement
        # scheme (e.g. a shard's fixed requests) does not say.
        self._produces_examples: bool | None = self._scheme_kind(iteration_scheme)

    @staticmethod
    def _scheme_kind(scheme: Any) -> bool | None:
        value = getattr(scheme, "requests_examples", None) if scheme is not None else None
        return None if value is None else bool(value)

    @property
    def produces_examples(self) -> bool:
        """Whether this stream yields single examples (True) or batches (False).

        Taken from the iteration scheme's ``requests_examples`` when there is one;
        otherwise it must have been set.

        Raises:
            StreamError: it cannot be inferred and was not set.
        """
        kind = self._scheme_kind(self.iteration_scheme)
        if kind is not None:
            return kind
        if self._produces_examples is None:
            return self._default_produces_examples()
        return self._produces_examples

    @produces_examples.setter
    def produces_examples(self, value: bool) -> None:
        if self._scheme_kind(self.iteration_scheme) is not None:
            raise StreamError(
                f"cannot set produces_examples on the {type(self).__name__} instance: it "
                f"is determined by its iteration scheme {self.iteration_scheme!r}"
            )
        self._produces_examples = bool(value)

    def _default_produces_examples(self) -> bool:
        """The kind when neither the scheme nor the user says; a transformer's child's."""
        raise StreamError(
            f"cannot infer whether the {type(self).__name__} instance produces examples "
            "or batches: set its produces_examples attribute to True (examples) or "
            "False (batches)"
        )

    @property
    def sources(self) -> tuple[str, ...]:
        """The names of the sources, in the order of the data tuples."""
        return getattr(self, "_sources", ())

    @sources.setter
    def sources(self, value: tuple[str, ...]) -> None:
        self._sources = tuple(value)

    def get_data(self, request: Any = None) -> Any:
        """Return the data for one request (a tuple in :attr:`sources` order)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_data")

    def reset(self) -> None:
        """Reset the stream to the start of an epoch."""

    def close(self) -> None:
        """Release what the stream holds (e.g. file handles)."""

    def next_epoch(self) -> None:
        """Switch the stream to the next epoch."""

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Return an iterator over one epoch.

        Args:
            as_dict: yield ``{source: value}`` dicts instead of tuples.
        """
        scheme = self.iteration_scheme
        requests = scheme.get_request_iterator() if scheme is not None else None
        return DataIterator(self, requests, as_dict=as_dict)

    def iterate_epochs(self, as_dict: bool = False) -> Iterator[Iterator[Any]]:
        """Yield one epoch iterator after the other, forever."""
        while True:
            yield self.get_epoch_iterator(as_dict=as_dict)


class DataStream(AbstractDataStream):
    """A stream of data from a dataset.

    Args:
        dataset: the dataset to read.
        iteration_scheme: the scheme whose requests are passed to
            ``dataset.get_data``; None for datasets that take no request (e.g.
            :class:`~producer.datasets.IterableDataset`), which then give examples.
        on_sample_error: 'raise' (default: a read that raises fails the batch's build,
            as in Fuel) or 'quarantine' (a scheme requesting example indices of an
            indexable dataset: the example that raised is recorded and replaced by a
            substitute, see :mod:`producer.datasets.sample_errors`).
        max_quarantined: with 'quarantine', the most examples that may be quarantined,
            a fraction of an epoch's examples (default 0.01): more is QuarantineExceeded
            (ProducerFailed to the trainer) naming them.
        **kwargs: ``axis_labels`` (defaults to a copy of the dataset's).

    Raises:
        ConfigError: quarantine asked of a stream whose failing read is not one
            example's (see :meth:`set_sample_errors`).
    """

    def __init__(
        self,
        dataset: Any,
        iteration_scheme: Any = None,
        *,
        on_sample_error: str = "raise",
        max_quarantined: float = DEFAULT_MAX_QUARANTINED,
        **kwargs: Any,
    ) -> None:
        if getattr(dataset, "axis_labels", None):
            kwargs.setdefault("axis_labels", dict(dataset.axis_labels))
        super().__init__(iteration_scheme=iteration_scheme, **kwargs)
        if iteration_scheme is None:
            # A stream without a scheme gives examples, as in Fuel.
            self.produces_examples = True
        if self.produces_examples and self.axis_labels:
            self.axis_labels = {
                source: None if labels is None else tuple(x for x in labels if x != "batch")
                for source, labels in self.axis_labels.items()
            }
        self.dataset = dataset
        self.data_state = self.dataset.open()
        self._fresh_state = True
        self._epoch = 0  # the epoch of the shard built (begin_shard); in-process: 0
        # Reads example by example where needed (quarantine, isolation): made where the
        # root reads examples by index, on the first call that needs it.
        self._reads: IndexedReads | None = None
        self._sample_settings = ("raise", DEFAULT_MAX_QUARANTINED)
        self.set_sample_errors(on_sample_error, max_quarantined)

    def set_sample_errors(self, on_sample_error: str | None, max_quarantined: float | None) -> None:
        """What a read that raises does (see the class's arguments; None keeps the
        current value). Set before the stream is served: the plan's fingerprint names it.

        Raises:
            ConfigError: an invalid value, or quarantine asked of a stream whose scheme
                requests no example indices or whose dataset is not indexable (the read
                that fails is not one example's: there is no example to replace).
        """
        mode = on_sample_error or self._sample_settings[0]
        fraction = self._sample_settings[1] if max_quarantined is None else max_quarantined
        check_sample_errors(mode, fraction)
        if mode == "quarantine":
            reads = self._reads or IndexedReads(self.dataset, self.iteration_scheme)
            reads.quarantine(mode, fraction)
            self._reads = reads
        elif self._reads is not None:
            self._reads.errors = None  # the read raises, as it always did
        self._sample_settings = (mode, fraction)

    @property
    def sample_errors(self) -> SampleErrors | None:
        """What this stream does with an example whose read raises (None: it raises)."""
        return None if self._reads is None else self._reads.errors

    def isolate(self, on: bool, timeout_s: float | None = None) -> bool:
        """Read each example in a forked child first (``on``; the producer sets it for a
        shard whose earlier attempt failed, :mod:`producer.isolation`): an example whose
        read kills the child or takes more than ``timeout_s`` raises ExampleKilled where
        its read would have raised (quarantined like an error, or the build fails).
        Returns whether the shard is built isolated: only where this stream reads its
        dataset by example index (else it is built as before)."""
        if self._reads is None:
            if not on:
                return False
            try:
                self._reads = IndexedReads(self.dataset, self.iteration_scheme)
            except ConfigError:
                return False  # no example read alone: nothing to isolate
        self._reads.isolate(on, timeout_s)
        return on

    @property
    def plan_fingerprint(self) -> dict[str, Any] | None:
        """What the plan's fingerprint adds for this stream: what a subclass set (a
        :class:`producer.mixture.Mixture`'s draws), and ``on_sample_error`` where it
        quarantines (its batches hold substitutes: producers must agree); None where
        there is nothing to add."""
        extra = getattr(self, "_plan_extra", None)
        if self.sample_errors is None:
            return extra
        return {**(extra or {}), "on_sample_error": "quarantine"}

    @plan_fingerprint.setter
    def plan_fingerprint(self, value: dict[str, Any] | None) -> None:
        self._plan_extra = value

    def begin_shard(self, epoch: int, shard: int) -> None:
        """Called by the shard plan before each shard: its epoch (the substitutes')."""
        self._epoch = epoch

    @property
    def sources(self) -> tuple[str, ...]:
        """The dataset's sources, unless set on the stream."""
        if hasattr(self, "_sources"):
            return self._sources
        return tuple(self.dataset.sources)

    @sources.setter
    def sources(self, value: tuple[str, ...]) -> None:
        self._sources = tuple(value)

    def close(self) -> None:
        """Close the dataset's state."""
        self.data_state = self.dataset.close(self.data_state)

    def reset(self) -> None:
        """Reset the dataset's state; the next epoch iterator starts from it."""
        self.data_state = self.dataset.reset(self.data_state)
        self._fresh_state = True

    def next_epoch(self) -> None:
        """Move the dataset's state to the next epoch."""
        self.data_state = self.dataset.next_epoch(self.data_state)

    def get_data(self, request: Any = None) -> Any:
        """Return ``dataset.get_data(state, request)`` (with quarantine, an example whose
        read raises replaced by its substitute)."""
        reads = self._reads
        if reads is not None and reads.active:
            return reads.read(self._read, request, self._epoch)
        return self.dataset.get_data(self.data_state, request)

    def _read(self, request: Any) -> Any:
        return self.dataset.get_data(self.data_state, request)

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Return an iterator over the next epoch (the first one uses the fresh state).

        Reads ``self.iteration_scheme`` now and calls its ``get_request_iterator()``
        with no argument before returning (see the module's sharding contract).
        """
        if not self._fresh_state:
            self.next_epoch()
        else:
            self._fresh_state = False
        return super().get_epoch_iterator(as_dict=as_dict)

    @classmethod
    def default_stream(cls, dataset: Any, **kwargs: Any) -> Any:
        """Build ``cls(dataset, **kwargs)`` and wrap it in the dataset's default transformers."""
        return dataset.apply_default_transformers(cls(dataset, **kwargs))
