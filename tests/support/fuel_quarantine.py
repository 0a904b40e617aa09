"""Fuel pipelines with broken examples, importable by producer processes (``batchq serve``):
the dataset's read of a batch holding a bad example raises, as an HDF5 read of a corrupt
chunk would.

Each example's ``features`` are ``index * FEATURES + arange(FEATURES)`` (a batch tells which
examples it holds: ``features[:, 0] // FEATURES``); a random transformer adds ``noise``
drawn per batch (from its generator, reseeded per shard by the plan).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from producer.datasets import IndexableDataset, IterableDataset
from producer.randomness import RandomStateMixin
from producer.schemes import ConstantScheme, SequentialExampleScheme, ShuffledScheme
from producer.streams import DataStream
from producer.transformers import Batch, Transformer

FEATURES = 4


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"TEST_{name.upper()}", default))


def bad_examples(variable: str = "TEST_BAD") -> set[int]:
    """The examples that raise (TEST_BAD: comma-separated indices), or those another
    variable names."""
    return {int(i) for i in os.environ.get(variable, "").split(",") if i}


class BrokenIndexable(IndexableDataset):
    """An IndexableDataset whose read raises where the request holds an example of ``bad``
    (naming the first), and kills the process where it holds one of ``abort`` (a native
    crash); ``reads`` counts each example's reads in this process."""

    def __init__(
        self, indexables: Any, bad: set[int], abort: frozenset[int] = frozenset(), **kwargs: Any
    ) -> None:
        super().__init__(indexables, **kwargs)
        self.bad, self.abort = frozenset(bad), abort
        self.reads: dict[int, int] = {}

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        asked = [int(i) for i in np.atleast_1d(np.asarray(request))]
        for i in asked:
            self.reads[i] = self.reads.get(i, 0) + 1
        if self.abort.intersection(asked):
            os.abort()  # as a decoder's failed assert does
        hit = [i for i in asked if i in self.bad]
        if hit:
            raise ValueError(f"example {hit[0]}: corrupt record")
        return super().get_data(state, request)


class Noise(RandomStateMixin, Transformer):
    """Adds a ``noise`` source: one uniform draw per example of each batch."""

    def __init__(self, data_stream: Any, rng: Any = None) -> None:
        super().__init__(data_stream)
        self.rng = rng
        self.sources = (*data_stream.sources, "noise")

    def transform_batch(self, batch: Any) -> Any:
        return (*batch, self.uniform(0.0, 1.0, len(batch[0])))


class HangOn(Transformer):
    """Never returns the batch that holds example ``hang`` (a stuck decoder above the
    dataset's read: the isolated read of the root does not bound it)."""

    def __init__(self, data_stream: Any, hang: int) -> None:
        super().__init__(data_stream)
        self.hang = hang
        self.sources = data_stream.sources

    def transform_batch(self, batch: Any) -> Any:
        if self.hang in (np.asarray(batch[0])[:, 0] // FEATURES).tolist():
            threading.Event().wait()  # forever: only the build's watch ends it
        return batch


def dataset(examples: int, bad: set[int]) -> BrokenIndexable:
    """``examples`` examples, those of ``bad`` raising, those of TEST_ABORT aborting."""
    features = np.arange(examples * FEATURES, dtype=np.int64).reshape(examples, FEATURES)
    abort = frozenset(bad_examples("TEST_ABORT"))
    return BrokenIndexable({"features": features, "targets": np.arange(examples)}, bad, abort)


def broken_stream(examples: int | None = None, batch_size: int | None = None) -> Any:
    """A shuffled batch scheme over BrokenIndexable (TEST_EXAMPLES, TEST_BATCH_SIZE,
    TEST_BAD), then Noise: reads that raise as they are (what ``batchq serve
    --on-sample-error`` changes)."""
    n = examples or _env("examples", 200)
    scheme = ShuffledScheme(n, batch_size or _env("batch_size", 10), rng=_env("seed", 7))
    return Noise(DataStream(dataset(n, bad_examples()), iteration_scheme=scheme), rng=5)


def quarantine_stream(examples: int | None = None, batch_size: int | None = None) -> Any:
    """broken_stream with quarantine set on the DataStream's own arguments
    (TEST_MAX_QUARANTINED: per mille, default 20)."""
    n = examples or _env("examples", 200)
    scheme = ShuffledScheme(n, batch_size or _env("batch_size", 10), rng=_env("seed", 7))
    root = DataStream(
        dataset(n, bad_examples()), iteration_scheme=scheme, on_sample_error="quarantine",
        max_quarantined=_env("max_quarantined", 20) / 1000,
    )  # fmt: skip
    return Noise(root, rng=5)


def hanging_stream(examples: int | None = None, batch_size: int | None = None) -> Any:
    """broken_stream whose batch holding example TEST_HANG never comes out of HangOn."""
    n = examples or _env("examples", 200)
    scheme = ShuffledScheme(n, batch_size or _env("batch_size", 10), rng=_env("seed", 7))
    root = DataStream(dataset(n, bad_examples()), iteration_scheme=scheme)
    return HangOn(root, _env("hang", 0))


def example_stream(examples: int | None = None, batch_size: int | None = None) -> Any:
    """An example scheme over BrokenIndexable, batched by ``Batch``, then Noise."""
    n = examples or _env("examples", 200)
    root = DataStream(dataset(n, bad_examples()), iteration_scheme=SequentialExampleScheme(n))
    batched = Batch(root, ConstantScheme(batch_size or _env("batch_size", 10)))
    return Noise(batched, rng=5)


def iterable_stream() -> Any:
    """A stream over an IterableDataset (no example index to replace), batched."""
    n = _env("examples", 200)
    root = DataStream(IterableDataset({"features": np.arange(n * FEATURES).reshape(n, FEATURES)}))
    return Batch(root, ConstantScheme(_env("batch_size", 10)))
