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

import numbers
from collections.abc import Callable, Sequence
from typing import Any

from batchq.errors import ConfigError
from producer.datasets.base import IterableDataset
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
    if isinstance(dataset, IterableDataset) or not valid:
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
    """How a DataStream with ``on_sample_error='quarantine'`` reads its requests.

    Args:
        dataset: the root's dataset (indexable, see :func:`check_indexable`).
        scheme: the root's iteration scheme (requests of example indices).
        mode: 'quarantine' (the only mode that reads through here).
        max_quarantined: the most examples quarantined, a fraction of an epoch's.

    Raises:
        ConfigError: the dataset or scheme reads no example by itself, or a value is
            invalid.
    """

    def __init__(self, dataset: Any, scheme: Any, mode: str, max_quarantined: float) -> None:
        examples, pool = check_indexable(dataset, scheme)
        seed = getattr(scheme, "seed", None)
        self.errors = SampleErrors(
            mode, max_quarantined, int(seed or 0), examples, len(pool), pool=pool
        )

    def read(self, read: Read, request: Any, epoch: int) -> Any:
        """``read(request)``, an example whose read raises replaced by its substitute.

        Raises:
            QuarantineExceeded: more examples than max_quarantined raised.
            Exception: a batch whose examples all read alone but not together (its
                read's error: not one example's).
        """
        errors = self.errors
        index = _example(request)
        if index is not None:
            return errors.read(read, index, epoch, _no_reseed)
        indices = _batch(request)
        if indices is None:
            return read(request)

        def probe(i: int) -> int:
            read([i])  # raises where example i does
            return i

        bad = errors.known_bad.intersection(indices)
        if bad:
            # Replaced before any read: a known bad example is not read again.
            request = [errors.read(probe, i, epoch, _no_reseed) if i in bad else i for i in indices]
        try:
            return read(request)
        except Exception:
            # Example by example (from the request as planned: the same substitutes
            # whatever this producer knew), then the batch with its substitutes.
            resolved = [errors.read(probe, i, epoch, _no_reseed) for i in indices]
        return read(resolved)
