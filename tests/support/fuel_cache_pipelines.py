"""Fuel pipelines with a cached per-example stage (``batchq serve
fuel_cache_pipelines:...``), and the same pipelines without the cache.

Example ``i`` of the dataset is ``(image, i)``, the image random bytes from ``i``
(channels, height, width). Per example: :class:`Darken` (the deterministic stage, in a
``Mapping``), then ``RandomFixedSizeCrop`` (the random part, reseeded per shard), then
batches. Cached, the ``Mapping``'s function is ``cached_mapping(Darken(k), ...)``: the
same chain, so the same plan and seeds.

Settings from the environment: TEST_EXAMPLES, TEST_CACHE_DIR, TEST_MAX_BYTES (0: the
default cap), TEST_DARKEN (the stage's setting: a changed one is another stage).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from producer.cache_store import DiskCache
from producer.datasets import IndexableDataset
from producer.schemes import ConstantScheme, ShuffledExampleScheme
from producer.streams import DataStream
from producer.transformers import Batch, Mapping, RandomFixedSizeCrop, cached_mapping

SIDE, CROP, BATCH, SEED = 12, 8, 4, 5


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"TEST_{name.upper()}", default))


class Darken:
    """The deterministic stage: ``(image // k, label)`` (its repr names ``k``)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, example: tuple[np.ndarray, Any]) -> tuple[np.ndarray, Any]:
        image, label = example
        return image // self.k, label

    def __repr__(self) -> str:
        return f"Darken(k={self.k})"


def dataset(examples: int) -> IndexableDataset:
    images = np.stack(
        [
            np.random.default_rng(i).integers(0, 256, (3, SIDE, SIDE), np.uint8)
            for i in range(examples)
        ]
    )
    return IndexableDataset(
        {"image": images, "label": np.arange(examples)},
        axis_labels={"image": ("batch", "channel", "height", "width"), "label": ("batch",)},
    )


def pipeline(stage: Any, examples: int | None = None) -> Any:
    """Examples shuffled, ``Mapping(stage)``, a random crop, batches of BATCH."""
    n = examples or _env("examples", 32)
    stream: Any = DataStream(dataset(n), iteration_scheme=ShuffledExampleScheme(n, rng=SEED))
    stream = Mapping(stream, stage, axis_labels=dict(stream.axis_labels))
    stream = RandomFixedSizeCrop(stream, (CROP, CROP), which_sources=("image",))
    return Batch(stream, ConstantScheme(BATCH))


def uncached_stream(examples: int | None = None) -> Any:
    """The pipeline without the cache."""
    return pipeline(Darken(_env("darken", 3)), examples)


def cached_stream(
    examples: int | None = None, cache_dir: str | None = None, measure: bool = False
) -> Any:
    """The same pipeline, its Mapping's function cached (always used: measure=False)."""
    directory = cache_dir or os.environ["TEST_CACHE_DIR"]
    cache = DiskCache(directory, max_bytes=_env("max_bytes", 0) or None)
    return pipeline(cached_mapping(Darken(_env("darken", 3)), cache, measure=measure), examples)
