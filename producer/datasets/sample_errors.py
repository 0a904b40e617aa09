"""``on_sample_error='quarantine'`` for a Fuel pipeline whose root reads examples by index.

A :class:`producer.streams.DataStream` whose iteration scheme requests example indices
(a batch scheme such as ``ShuffledScheme`` or ``SequentialScheme``: one list of indices
per batch; an example scheme such as ``SequentialExampleScheme``: one index per request,
batched above by a ``Batch`` transformer) of an indexable dataset (``IndexableDataset``,
``NpyDataset``, ``H5PYDataset``, any :class:`~producer.datasets.base.Dataset` whose
``get_data`` takes an index or a list of indices) reads through :class:`IndexedReads`
with ``on_sample_error='quarantine'``:

- an example request whose read raises is replaced by its substitute's read
  (:meth:`producer.quarantine.SampleErrors.read`: the same rule, records and cap as a
  torch dataset's);
- a batch request whose read raises is resolved example by example: each index is read
  alone (``get_data(state, [i])``), one that raises is recorded and replaced by its
  substitute, then the batch is read again with the substitutes in place, so it keeps
  its size and the dataset's own batch format. Known bad examples are replaced before
  the first read (no read of them again).

Substitutes are drawn among the scheme's examples (a scheme over a subset never draws an
example outside it), from the scheme's seed (0 for a scheme without one). The dataset's
reads are taken as deterministic (Fuel's datasets are): the substitutes' randomness is
the transformers', reseeded per shard by the plan, and a batch keeps its size, so every
transformer draws the same numbers wherever the batch is built.

Not covered, and refused (ConfigError) where it can be told in advance: a scheme that
requests no example indices (batch sizes, as ``ConstantScheme`` over an
``IterableDataset``; a slice; a mixture's draws), a dataset without ``num_examples``: the
read that fails is not one example's, so there is no example to replace. A transformer
that raises (a batch-level stage) is not the dataset's read either: its error fails the
build as before (``ProducerFailed`` after ``max_attempts``).
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from batchq.errors import ConfigError
from producer.isolation import ChildReader
from producer.quarantine import SampleErrors
from producer.schemes import BatchScheme, IndexScheme

__all__ = ["IndexedReads", "check_indexable"]

Read = Callable[[Any], Any]  # a request -> the dataset's data for it


def check_indexable(dataset: Any, scheme: Any) -> tuple[int, Sequence[int]]:
    """The dataset's size and the scheme's examples, where quarantine can replace one.

    Raises:
        ConfigError: naming the dataset or scheme and what was expected.
    """
    what = f"on_sample_error='quarantine' given for a DataStream over {type(dataset).__name__}"
    if not isinstance(scheme, (BatchScheme, IndexScheme)):
        how = (
            "without an iteration scheme" if scheme is None else f"read by {type(scheme).__name__}"
        )
        raise ConfigError(
            f"{what} {how}: expected an iteration scheme whose "
            "requests are example indices (a batch scheme such as ShuffledScheme or "
            "SequentialScheme, or an example scheme such as SequentialExampleScheme): a "
            "read that fails is then one example's, which a substitute replaces"
        )
    examples = getattr(dataset, "num_examples", None)
    valid = isinstance(examples, numbers.Integral) and not isinstance(examples, bool)
    by_index = getattr(dataset, "requests_by_index", True)  # Dataset declares it
    if not by_index or not valid or examples is None:
        raise ConfigError(
            f"{what}: expected an indexable dataset (an integer num_examples, get_data by "
            f"example index: IndexableDataset, NpyDataset, H5PYDataset), got num_examples "
            f"{examples!r}"
        )
    indices = scheme.indices
    if len(indices) and not 0 <= min(indices) <= max(indices) < int(examples):
        raise ConfigError(
            f"{what}: its scheme requests indices {min(indices)} to {max(indices)}, outside "
            f"the dataset's {examples} examples"
        )
    return int(examples), indices


def _no_reseed(seed: int) -> None:
    """A Fuel root draws nothing itself: its transformers are reseeded per shard."""


def _example(request: Any) -> int | None:
    """The request's one index, where it is an example request."""
    if isinstance(request, numbers.Integral) and not isinstance(request, bool):
        return int(request)
    return None


def _batch(request: Any) -> list[int] | None:
    """The request's indices, where it is a list (or array) of example indices."""
    if isinstance(request, (str, bytes, slice)) or not hasattr(request, "__len__"):
        return None
    indices = [_example(i) for i in request]
    return None if any(i is None for i in indices) else indices  # type: ignore[return-value]


class IndexedReads:
    """How a DataStream reads its requests example by example where needed: with
    ``on_sample_error='quarantine'`` (:attr:`errors`), or isolated (a shard whose earlier
    attempt failed: each example read first in a forked child, :mod:`producer.isolation`).

    Args:
        dataset: the root's dataset (indexable, see :func:`check_indexable`).
        scheme: the root's iteration scheme (requests of example indices).

    Raises:
        ConfigError: the dataset or scheme reads no example by itself.
    """

    def __init__(self, dataset: Any, scheme: Any) -> None:
        self.examples, self.pool = check_indexable(dataset, scheme)
        self.seed = int(getattr(scheme, "seed", None) or 0)
        # How one example is asked for alone: as the scheme asks (a batch scheme's
        # dataset may take lists only).
        self.batched = isinstance(scheme, BatchScheme)
        self.errors: SampleErrors | None = None
        self.isolated = False
        self._timeout_s: float | None = None
        self._child: ChildReader | None = None

    def quarantine(self, mode: str, max_quarantined: float) -> SampleErrors:
        """Replace an example whose read raises from now on (see the module)."""
        self.errors = SampleErrors(
            mode, max_quarantined, self.seed, self.examples, len(self.pool), pool=self.pool
        )
        return self.errors

    def isolate(self, on: bool, timeout_s: float | None) -> None:
        """Read each example in a forked child first (``on``), for at most
        ``timeout_s`` (:meth:`producer.torch.dataset.DatasetStream.isolate`'s meaning)."""
        self.isolated, self._timeout_s = on, timeout_s
        if not on and self._child is not None:
            self._child.close()  # forked again for the next isolated shard
            self._child = None

    @property
    def active(self) -> bool:
        """Whether the stream reads through here (else straight from its dataset)."""
        return self.errors is not None or self.isolated

    def read(self, read: Read, request: Any, epoch: int) -> Any:
        """``read(request)``, an example whose read raises replaced by its substitute
        (with quarantine), each example tried in the child first (isolated).

        Raises:
            ExampleKilled: isolated, without quarantine: an example killed its child or
                hung there.
            QuarantineExceeded: more examples than max_quarantined raised.
            Exception: what the read raised, without quarantine; with it, that of a
                batch whose examples all read alone but not together (not one
                example's).
        """
        index = _example(request)
        indices = [index] if index is not None else _batch(request)
        if indices is None:
            return read(request)
        if self.isolated:
            read = self._guarded(read)
        errors = self.errors
        if errors is None:
            return read(request)
        if index is not None:
            return errors.read(read, index, epoch, _no_reseed)

        def probe(i: int) -> int:
            read([i])  # raises where example i does
            return i

        bad = errors.known_bad.intersection(indices)
        if bad:
            # Replaced before any read: a known bad example is not read again.
            request = [errors.read(probe, i, epoch, _no_reseed) if i in bad else i for i in indices]
        if not self.isolated:  # (isolated: each example is tried alone first anyway)
            with contextlib.suppress(Exception):  # then example by example, below
                return read(request)
        # From the request as planned: the same substitutes whatever this producer
        # knew; then the batch with its substitutes in place.
        resolved = [errors.read(probe, i, epoch, _no_reseed) for i in indices]
        return read(resolved)

    def _guarded(self, read: Read) -> Read:
        """``read``, each example of the request tried in the child first."""

        def guarded(request: Any) -> Any:
            index = _example(request)
            for i in [index] if index is not None else _batch(request) or []:
                self._try(read, i)
            return read(request)

        return guarded

    def _try(self, read: Read, index: int) -> None:
        if self._child is None:
            batched = self.batched
            self._child = ChildReader(lambda i: read([i] if batched else i))
        self._child.try_read(index, f"example {index}", self._timeout_s)
