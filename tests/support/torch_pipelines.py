"""torch pipelines the tests serve (``batchq serve torch_pipelines:...``).

Every example tells where it came from: its index, plus augmentations drawn from
torch's, numpy's and Python's global generators, so a batch built twice (by another
producer, after a kill, after a resume) shows whether it got the same draws.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from producer.torch import DatasetStream

DIM = 4


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"TEST_{name.upper()}", default))


class RngDataset(Dataset[tuple[int, torch.Tensor]]):
    """``(i, augmentation)``: the augmentation draws from the three global generators.

    ``slow_ms``: a loading delay per example (so that a producer is busy mid-shard).
    """

    def __init__(self, n: int, slow_ms: float = 0.0) -> None:
        self.n = n
        self.slow_s = slow_ms / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        if self.slow_s:
            time.sleep(self.slow_s)
        aug = torch.rand(DIM) + float(np.random.rand()) + random.random()
        return i, aug + i


def rng_stream(
    examples: int | None = None, batch_size: int | None = None, seed: int = 3
) -> DatasetStream:
    """A shuffled DatasetStream over RngDataset (TEST_EXAMPLES, TEST_BATCH_SIZE, ...)."""
    n = examples or _env("examples", 120)
    return DatasetStream(
        RngDataset(n, slow_ms=_env("slow_ms", 0)),
        batch_size=batch_size or _env("batch_size", 8),
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        sources=("index", "aug"),
    )


def make_loader() -> DataLoader[Any]:
    """A training script's DataLoader, moved into a factory as it is."""
    return DataLoader(
        RngDataset(_env("examples", 60)),
        batch_size=_env("batch_size", 8),
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=2,
        pin_memory=True,
        prefetch_factor=4,
    )


class SplitRange(IterableDataset[dict[str, Any]]):
    """The torch docs' IterableDataset: ``range(n)`` split between workers by worker info."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        per = -(-self.n // workers)
        for i in range(wid * per, min(self.n, (wid + 1) * per)):
            yield {"value": i, "worker": wid, "workers": workers, "noise": torch.rand(2)}


def iterable_stream(num_shards: int = 3, batch_size: int = 4) -> DatasetStream:
    n = _env("examples", 50)
    return DatasetStream(SplitRange(n), batch_size=batch_size, num_shards=num_shards)


HF_EXAMPLES = 40


def _noisy(batch: dict[str, list[Any]]) -> dict[str, Any]:
    """A set_transform: called on each batch access, draws from torch's generator."""
    x = torch.tensor(batch["x"], dtype=torch.float32)
    return {
        "x": x + torch.rand(x.shape),
        "label": torch.tensor(batch["label"]),
        "name": batch["name"],
    }


def hf_stream(fmt: str = "transform") -> DatasetStream:
    """A Hugging Face ``datasets.Dataset`` made offline, in the format ``fmt``."""
    import datasets

    n = HF_EXAMPLES
    ds = datasets.Dataset.from_dict(
        {
            "x": [[float(i)] * 3 for i in range(n)],
            "label": list(range(n)),
            "name": [f"ex{i}" for i in range(n)],
        }
    )
    if fmt == "transform":
        ds.set_transform(_noisy)
    else:
        ds = ds.with_format(fmt)
    return DatasetStream(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


def bad_examples(variable: str = "TEST_BAD") -> set[int]:
    """The examples that raise (TEST_BAD: comma-separated indices), or those another
    variable names."""
    return {int(i) for i in os.environ.get(variable, "").split(",") if i}


class BrokenExamples(RngDataset):
    """RngDataset whose examples in ``bad`` raise, as a truncated file would; those in
    ``abort`` kill the process (a native crash), those in ``hang`` never return."""

    def __init__(
        self,
        n: int,
        bad: set[int],
        slow_ms: float = 0.0,
        abort: frozenset[int] = frozenset(),
        hang: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(n, slow_ms)
        self.bad, self.abort, self.hang = bad, abort, hang

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        if i in self.bad:
            raise ValueError(f"example {i}: truncated record")
        if i in self.abort:
            os.abort()  # as a decoder's failed assert does
        if i in self.hang:
            threading.Event().wait()  # forever
        return super().__getitem__(i)


def quarantine_stream(examples: int | None = None, batch_size: int | None = None) -> DatasetStream:
    """broken_stream with on_sample_error='quarantine' and TEST_MAX_QUARANTINED (per
    mille, default 10: 0.01)."""
    stream = broken_stream(examples, batch_size)
    stream.set_sample_errors("quarantine", _env("max_quarantined", 10) / 1000)
    return stream


def broken_stream(examples: int | None = None, batch_size: int | None = None) -> DatasetStream:
    """rng_stream over BrokenExamples (TEST_BAD; TEST_ABORT, TEST_HANG: comma-separated
    indices too), reads that raise as they are (what ``batchq serve --on-sample-error``
    changes)."""
    n = examples or _env("examples", 120)
    abort, hang = (frozenset(bad_examples(f"TEST_{kind}")) for kind in ("ABORT", "HANG"))
    return DatasetStream(
        BrokenExamples(n, bad_examples(), slow_ms=_env("slow_ms", 0), abort=abort, hang=hang),
        batch_size=batch_size or _env("batch_size", 8),
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        sources=("index", "aug"),
    )


class HangingExample(RngDataset):
    """RngDataset whose example ``hang`` never returns (a decoder stuck for good)."""

    def __init__(self, n: int, hang: int) -> None:
        super().__init__(n)
        self.hang = hang

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        if i == self.hang:
            threading.Event().wait()  # forever
        return super().__getitem__(i)


def hanging_stream() -> DatasetStream:
    """rng_stream over HangingExample (TEST_EXAMPLES, TEST_BATCH_SIZE, TEST_HANG)."""
    return DatasetStream(
        HangingExample(_env("examples", 120), _env("hang", 7)),
        batch_size=_env("batch_size", 8),
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        sources=("index", "aug"),
    )
