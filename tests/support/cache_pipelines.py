"""Pipelines with a cached stage (``batchq serve cache_pipelines:...``), and the same
pipelines without the cache.

:class:`Stage` is an ImageFolder in miniature: item ``i`` is ``(image, i)``, the image
made from ``i`` alone (HWC bytes viewed as CHW, as ``v2.ToImage`` makes them), then its
``transform``. Uncached, the transform is the stage's part and then :func:`jitter` (a
random crop and flip drawn from torch's, numpy's and Python's global generators);
cached, the dataset's transform is the stage's part and ``augment`` applies
:func:`jitter` to the image: the same computation, split at the cache.

Settings from the environment: TEST_EXAMPLES, TEST_CACHE_DIR, TEST_MAX_BYTES (0: the
default cap), TEST_BRIGHTEN (the stage's setting: a changed one is another stage),
TEST_SLOW_MS (a build's delay), TEST_BLOCK_BYTES (extra bytes per example).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from producer.torch import DatasetStream, DiskCache, cached

SIDE, CROP, BATCH, SEED = 16, 12, 8, 4


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"TEST_{name.upper()}", default))


class Brighten:
    """The stage's deterministic part: ``image // k`` (its repr names ``k``)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image // self.k

    def __repr__(self) -> str:
        return f"Brighten(k={self.k})"


def jitter(image: torch.Tensor) -> torch.Tensor:
    """The random part: a CROP x CROP crop at offsets from torch and numpy, a flip from
    Python's generator."""
    top = int(torch.randint(0, SIDE - CROP + 1, ()))
    left = int(np.random.randint(0, SIDE - CROP + 1))
    out = image[:, top : top + CROP, left : left + CROP]
    return out.flip(-1) if random.random() < 0.5 else out


class Then:
    """The uncached transform: ``second(first(x))``."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __call__(self, x: Any) -> Any:
        return self.second(self.first(x))

    def __repr__(self) -> str:
        return f"Then({self.first!r}, {self.second.__name__})"


def jitter_image(item: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """``augment``: :func:`jitter` on the image of an ``(image, label)`` item."""
    return jitter(item[0]), item[1]


class Stage(Dataset[tuple[torch.Tensor, int]]):
    """``(transform(image of i), i)``; ``block_bytes``: more rows (bigger entries)."""

    def __init__(self, n: int, transform: Any, slow_ms: float = 0.0, block_bytes: int = 0) -> None:
        self.n, self.transform = n, transform
        self.slow_s, self.rows = slow_ms / 1000, SIDE + block_bytes // (SIDE * 3)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.slow_s:
            time.sleep(self.slow_s)
        hwc = np.random.default_rng(i).integers(0, 256, (self.rows, SIDE, 3), dtype=np.uint8)
        image = torch.from_numpy(hwc).permute(2, 0, 1)  # a CHW view of HWC bytes
        return self.transform(image), i  # jitter crops within the first SIDE rows


def stage(examples: int | None = None, brighten: int | None = None) -> Stage:
    n = examples or _env("examples", 64)
    k = brighten or _env("brighten", 2)
    return Stage(n, Brighten(k), _env("slow_ms", 0), _env("block_bytes", 0))


def stream_of(dataset: Any) -> DatasetStream:
    return DatasetStream(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        sources=("image", "label"),
    )


def uncached_stream(examples: int | None = None) -> DatasetStream:
    """The pipeline without the cache: one dataset applying the stage, then jitter."""
    base = stage(examples)
    base.transform = Then(base.transform, jitter)
    return stream_of(base)


def cached_stream(examples: int | None = None, cache_dir: str | None = None) -> DatasetStream:
    """The same pipeline, cached at the split (always used: measure=False)."""
    directory = cache_dir or os.environ["TEST_CACHE_DIR"]
    cache = DiskCache(directory, max_bytes=_env("max_bytes", 0) or None)
    return stream_of(cached(stage(examples), augment=jitter_image, cache=cache, measure=False))
