"""Iteration schemes: which requests (indices, slices, batch sizes) make up an epoch.

Same names, arguments and request formats as ``fuel.schemes``, with one addition that
batchq relies on: **every scheme is deterministic per epoch**.
``get_request_iterator(epoch=e)`` returns the requests of epoch ``e`` as a pure function
of ``(scheme.seed, e)`` and the constructor arguments, whatever this process iterated
before, so any producer can rebuild any part of any epoch. Called with no argument (as
Fuel code and :class:`~producer.streams.DataStream` do), each call returns the next
epoch of this object: 0, 1, 2, ...

Shuffled schemes have two regimes (see :mod:`producer.randomness`):

* ``rng`` a ``numpy.random.RandomState`` (Fuel's regime): epoch ``e`` is exactly the
  permutation Fuel's scheme yields at its ``(e+1)``-th epoch for the same RandomState
  (a snapshot is replayed, so any epoch is still computed directly);
* ``rng`` ``None`` (seed :data:`DEFAULT_SEED`), an int seed or a ``Generator`` (one
  seed drawn at construction): epoch ``e``'s permutation is drawn from
  ``numpy.random.default_rng([seed, e])``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from producer._cross_validation import cross_validation
from producer._scheme_args import (
    check_batch_size,
    check_count,
    check_epoch,
    normalize_examples,
)
from producer.errors import ConfigError, SchemeError
from producer.randomness import DEFAULT_SEED, FuelShuffles, RngLike, seed_from_rng

__all__ = [
    "DEFAULT_SEED",
    "BatchScheme",
    "BatchSizeScheme",
    "ConcatenatedScheme",
    "ConstantScheme",
    "IndexScheme",
    "IterationScheme",
    "SequentialExampleScheme",
    "SequentialScheme",
    "ShuffledExampleScheme",
    "ShuffledScheme",
    "cross_validation",
    "seed_from_rng",
]

log = logging.getLogger(__name__)


def _fuel_shuffles(rng: RngLike, count: int) -> FuelShuffles | None:
    """Fuel's regime for a RandomState (replayed shuffles), else None."""
    return FuelShuffles(rng, count) if isinstance(rng, np.random.RandomState) else None


def _rng_attribute(rng: RngLike, seed: int) -> np.random.RandomState | np.random.Generator:
    """Fuel's ``scheme.rng``: the RandomState or Generator given, else one from the seed.

    Informational: the epochs' orders are fixed at construction (reassigning it does not
    change them, unlike Fuel's).
    """
    if isinstance(rng, np.random.RandomState | np.random.Generator):
        return rng
    return np.random.default_rng(seed)


def _permutation(
    indices: range | list[int], seed: int, epoch: int, fuel: FuelShuffles | None = None
) -> np.ndarray:
    """Epoch ``epoch``'s order of ``indices``: a pure function of (rng, epoch)."""
    epoch = check_epoch(epoch)
    if fuel is not None:
        perm = fuel.order(epoch)
    else:
        perm = np.random.default_rng([seed, epoch]).permutation(len(indices))
    if isinstance(indices, range) and indices.start == 0 and indices.step == 1:
        return perm
    out: np.ndarray = np.asarray(indices, dtype=np.int64)[perm]
    return out


def _accepts_epoch(scheme: Any) -> bool:
    """Whether ``scheme.get_request_iterator`` takes ``epoch`` (Fuel-era schemes do not)."""
    try:
        return "epoch" in inspect.signature(scheme.get_request_iterator).parameters
    except (TypeError, ValueError):
        return False


class IterationScheme:
    """Base of all iteration schemes.

    Subclasses implement :meth:`_epoch_requests` (a pure function of the epoch);
    Fuel-style subclasses that override :meth:`get_request_iterator` directly keep
    working, without the per-epoch determinism.

    Attributes:
        requests_examples: whether a request is one example (True) or a batch (False).
        seed: the int the scheme's randomness derives from, or None if it has none.
    """

    requests_examples: bool
    seed: int | None = None

    def get_request_iterator(self, epoch: int | None = None) -> Iterator[Any]:
        """Return an iterator over the requests of one epoch.

        Args:
            epoch: which epoch (>= 0). ``None`` means the next epoch of this object
                (0 on the first such call, then 1, 2, ...); explicit epochs do not
                move that counter.

        Returns:
            An iterator over the epoch's requests.
        """
        if epoch is None:
            epoch = getattr(self, "_next_epoch", 0)
            self._next_epoch = epoch + 1
        return self._epoch_requests(check_epoch(epoch))

    def _epoch_requests(self, epoch: int) -> Iterator[Any]:
        raise NotImplementedError(
            f"{type(self).__name__} implements neither _epoch_requests nor get_request_iterator"
        )

    def num_requests(self, epoch: int = 0) -> int | None:
        """How many requests epoch ``epoch`` has, computed without iterating.

        Returns:
            The count, or None when it is unknown or infinite (e.g. a
            :class:`ConstantScheme` without ``times`` or ``num_examples``).
        """
        return None


class BatchSizeScheme(IterationScheme):
    """A scheme whose requests are batch sizes (ints), for datasets without indices."""

    requests_examples = False


class BatchScheme(IterationScheme):
    """A scheme whose requests are lists of example indices, one list per batch.

    Args:
        examples: an int n (the examples ``0 .. n-1``) or an iterable of indices.
        batch_size: the number of indices per request; the last one may be smaller.

    Raises:
        BatchSizeError: ``batch_size`` is not an int > 0.
        ConfigError: ``examples`` is neither a count nor integer indices.
    """

    requests_examples = False

    def __init__(self, examples: int | Iterable[int], batch_size: int) -> None:
        self.indices = normalize_examples(examples)
        self.batch_size = check_batch_size(batch_size)

    @property
    def num_examples(self) -> int:
        """How many examples one epoch covers."""
        return len(self.indices)

    def num_requests(self, epoch: int = 0) -> int:
        """``ceil(num_examples / batch_size)``, the same for every epoch."""
        return math.ceil(len(self.indices) / self.batch_size)

    def _batches(self, order: Sequence[int] | np.ndarray) -> Iterator[list[int]]:
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            yield chunk.tolist() if isinstance(chunk, np.ndarray) else list(chunk)


class IndexScheme(IterationScheme):
    """A scheme whose requests are single example indices (ints).

    Args:
        examples: an int n (the examples ``0 .. n-1``) or an iterable of indices.
    """

    requests_examples = True

    def __init__(self, examples: int | Iterable[int]) -> None:
        self.indices = normalize_examples(examples)

    @property
    def num_examples(self) -> int:
        """How many examples one epoch covers."""
        return len(self.indices)

    def num_requests(self, epoch: int = 0) -> int:
        """``num_examples``: one request per example."""
        return len(self.indices)


class ConstantScheme(BatchSizeScheme):
    """Requests the same batch size, a fixed number of times or forever.

    Args:
        batch_size: the batch size to request.
        num_examples: if given, request ``batch_size`` until the sizes sum to
            ``num_examples`` (the last request may be smaller).
        times: if given, request ``batch_size`` exactly ``times`` times.

    Raises:
        BatchSizeError: ``batch_size`` is not an int > 0.
        ConfigError: both ``num_examples`` and ``times`` are given, or one is negative.
    """

    def __init__(
        self, batch_size: int, num_examples: int | None = None, times: int | None = None
    ) -> None:
        if num_examples is not None and times is not None:
            raise ConfigError(
                f"num_examples={num_examples!r} and times={times!r} were both given: "
                "expected at most one of them"
            )
        self.batch_size = check_batch_size(batch_size)
        self.num_examples = (
            None if num_examples is None else check_count("num_examples", num_examples)
        )
        self.times = None if times is None else check_count("times", times)

    def num_requests(self, epoch: int = 0) -> int | None:
        """``times``, or ``ceil(num_examples / batch_size)``, or None (infinite)."""
        if self.times is not None:
            return self.times
        if self.num_examples is not None:
            return math.ceil(self.num_examples / self.batch_size)
        return None

    def _epoch_requests(self, epoch: int) -> Iterator[int]:
        if self.times is not None:
            return itertools.repeat(self.batch_size, self.times)
        if self.num_examples is not None:
            full, rest = divmod(self.num_examples, self.batch_size)
            return itertools.chain(itertools.repeat(self.batch_size, full), [rest] if rest else [])
        return itertools.repeat(self.batch_size)


class SequentialScheme(BatchScheme):
    """Batches of consecutive examples, in order; the last batch may be smaller."""

    def _epoch_requests(self, epoch: int) -> Iterator[list[int]]:
        return self._batches(self.indices)


class ShuffledScheme(BatchScheme):
    """Batches of examples in a new random order every epoch.

    Args:
        examples: an int n (the examples ``0 .. n-1``) or an iterable of indices.
        batch_size: the number of indices per request; the last one may be smaller.
        rng: a RandomState (Fuel's permutations), or None, an int seed or a numpy
            Generator (batchq's; see the module docstring).
        sorted_indices: sort the indices inside each batch (reads stay local).
    """

    def __init__(
        self,
        examples: int | Iterable[int],
        batch_size: int,
        rng: RngLike = None,
        sorted_indices: bool = False,
    ) -> None:
        super().__init__(examples, batch_size)
        self.seed: int = seed_from_rng(rng)
        self._fuel = _fuel_shuffles(rng, len(self.indices))
        self.rng = _rng_attribute(rng, self.seed)
        self.sorted_indices = bool(sorted_indices)

    def permutation(self, epoch: int) -> np.ndarray:
        """The example order of epoch ``epoch``: a pure function of (rng, epoch)."""
        return _permutation(self.indices, self.seed, epoch, self._fuel)

    def _epoch_requests(self, epoch: int) -> Iterator[list[int]]:
        order = self.permutation(epoch)
        if not self.sorted_indices:
            return self._batches(order)
        return (sorted(batch) for batch in self._batches(order))


class SequentialExampleScheme(IndexScheme):
    """Single examples, in order."""

    def _epoch_requests(self, epoch: int) -> Iterator[int]:
        return iter(self.indices)


class ShuffledExampleScheme(IndexScheme):
    """Single examples, in a new random order every epoch.

    Args:
        examples: an int n (the examples ``0 .. n-1``) or an iterable of indices.
        rng: a RandomState (Fuel's permutations), or None, an int seed or a numpy
            Generator (batchq's; see the module docstring).
    """

    def __init__(self, examples: int | Iterable[int], rng: RngLike = None) -> None:
        super().__init__(examples)
        self.seed: int = seed_from_rng(rng)
        self._fuel = _fuel_shuffles(rng, len(self.indices))
        self.rng = _rng_attribute(rng, self.seed)

    def permutation(self, epoch: int) -> np.ndarray:
        """The example order of epoch ``epoch``: a pure function of (rng, epoch)."""
        return _permutation(self.indices, self.seed, epoch, self._fuel)

    def _epoch_requests(self, epoch: int) -> Iterator[int]:
        return iter(self.permutation(epoch).tolist())


class ConcatenatedScheme(IterationScheme):
    """The requests of several schemes, one after the other, every epoch.

    Epoch e of the concatenation is epoch e of each child scheme, so it stays a pure
    function of the epoch when the children are.

    Args:
        schemes: the schemes, all requesting examples or all requesting batches.

    Raises:
        SchemeError: ``schemes`` is empty or mixes example and batch schemes.
    """

    def __init__(self, schemes: Sequence[IterationScheme]) -> None:
        self.schemes = list(schemes)
        kinds = {bool(s.requests_examples) for s in self.schemes}
        if len(kinds) != 1:
            found = [f"{type(s).__name__}({s.requests_examples})" for s in self.schemes]
            raise SchemeError(
                "all schemes must produce the same type of requests (examples or "
                f"batches); got requests_examples {found or 'of no scheme'}"
            )

    @property
    def requests_examples(self) -> bool:  # type: ignore[override]
        """The children's kind of request."""
        return bool(self.schemes[0].requests_examples)

    @property
    def seed(self) -> int | None:  # type: ignore[override]
        """None if no child is random, else an int derived from the children's seeds."""
        seeds = [int(seed) for s in self.schemes if (seed := getattr(s, "seed", None)) is not None]
        if not seeds:
            return None
        return int(np.random.SeedSequence(seeds).generate_state(1)[0])

    def num_requests(self, epoch: int = 0) -> int | None:
        """The children's counts summed, or None if one is unknown."""
        total = 0
        for scheme in self.schemes:
            count = scheme.num_requests(epoch) if hasattr(scheme, "num_requests") else None
            if count is None:
                return None
            total += count
        return total

    def _epoch_requests(self, epoch: int) -> Iterator[Any]:
        # Fuel-era children (no ``epoch`` parameter) just give their next epoch.
        iterators = [
            s.get_request_iterator(epoch=epoch) if _accepts_epoch(s) else s.get_request_iterator()
            for s in self.schemes
        ]
        return itertools.chain.from_iterable(iterators)
