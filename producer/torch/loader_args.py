"""DataLoader's arguments, as a torch dataset's stream takes them, and their checks.

:class:`~producer.torch.dataset.DatasetStream` takes a DataLoader's arguments; it keeps
them as one :class:`LoaderArgs` and hands them to the stream of its kind of dataset
(map-style or iterable), whose checks are here with DataLoader's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchq.errors import ConfigError
from producer.config import default_seed

__all__ = [
    "LoaderArgs",
    "check_batching",
    "check_common",
    "check_iterable",
    "check_map_style",
    "check_seed",
    "check_threads",
    "default_samplers",
]


@dataclass(frozen=True)
class LoaderArgs:
    """A DataLoader's arguments as given (see :class:`producer.torch.dataset.DatasetStream`)."""

    dataset: Any
    batch_size: int | None
    shuffle: bool
    drop_last: bool
    collate_fn: Callable[[Any], Any] | None
    generator: Any
    sampler: Any
    batch_sampler: Any
    sources: Sequence[str] | None
    seed: int | None
    num_shards: int | None
    worker_init_fn: Callable[[int], Any] | None
    torch_threads: int | None


def check_seed(seed: Any) -> int:
    """The run's seed for the orders and per-batch seeds (None: Fuel's default seed).

    Raises:
        ConfigError: not an integer >= 0 or None.
    """
    if seed is None:
        return int(default_seed)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed {seed!r} is not valid: expected an integer >= 0 or None")
    return seed


def check_threads(threads: Any) -> int | None:
    """torch's intra-op threads per producer (None: torch's own default).

    Raises:
        ConfigError: not an integer >= 1 or None.
    """
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ConfigError(
            f"torch_threads {threads!r} is not valid: expected an integer >= 1 or None"
        )
    return threads


def check_map_style(
    dataset: Any, num_shards: int | None, worker_init_fn: Any, generator: Any
) -> None:
    """A map-style dataset and the arguments that go with one (DataLoader's messages)."""
    import torch

    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"dataset {dataset!r} is not valid: expected a map-style dataset "
            "(__len__ and __getitem__) or a torch IterableDataset"
        )
    if num_shards is not None or worker_init_fn is not None:
        raise ConfigError(
            "num_shards and worker_init_fn are for an IterableDataset: a map-style "
            "dataset is cut into one shard per batch"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator {generator!r} is not valid: expected a torch.Generator")


def check_batching(
    batch_size: int | None, shuffle: bool, drop_last: bool, sampler: Any, batch_sampler: Any
) -> int | None:
    """DataLoader's exclusions between its batching arguments; the batch size in effect
    (None with a batch sampler)."""
    if sampler is not None and shuffle:
        raise ConfigError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ConfigError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                "sampler, and drop_last"
            )
        return None
    if batch_size is None and drop_last:
        raise ConfigError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )
    return batch_size


def default_samplers(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool,
    drop_last: bool,
    generator: Any,
    sampler: Any,
    batch_sampler: Any,
) -> tuple[Any, Any]:
    """DataLoader's default sampler and batch sampler, the same objects it would make."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    if sampler is None:
        sampler = (
            RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        )
    if batch_size is not None:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return sampler, batch_sampler


def check_common(batch_size: Any, collate_fn: Any, sources: Any) -> None:
    """The arguments a map-style and an iterable dataset's streams share.

    Raises:
        ConfigError: a batch size that is not a positive integer or None, a collate_fn
            that is not callable, or sources that are not a sequence of names.
    """
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ConfigError(
            f"batch_size {batch_size!r} is not valid: expected an integer >= 1 or None"
        )
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError(f"collate_fn {collate_fn!r} is not valid: expected a callable")
    if sources is not None and (isinstance(sources, str) or not isinstance(sources, Sequence)):
        raise ConfigError(f"sources {sources!r} is not valid: expected a sequence of names")


def check_iterable(args: LoaderArgs) -> int:
    """The arguments that go with an IterableDataset (DataLoader's messages); the
    number of shards (default 1).

    Raises:
        ConfigError: an argument DataLoader refuses for an IterableDataset, or invalid.
    """
    for name, value in (("shuffle", args.shuffle or None), ("sampler", args.sampler)):
        if value is not None:
            raise ConfigError(
                f"DataLoader with IterableDataset: expected unspecified {name} option, "
                f"but got {name}={value!r}"
            )
    if args.batch_sampler is not None or args.generator is not None:
        raise ConfigError(
            "DataLoader with IterableDataset: batch_sampler and generator are not "
            "used (the dataset's own __iter__ gives the order)"
        )
    if args.batch_size is None and args.drop_last:
        raise ConfigError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )
    shards = 1 if args.num_shards is None else args.num_shards
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"num_shards {args.num_shards!r} is not valid: expected an integer >= 1")
    if args.worker_init_fn is not None and not callable(args.worker_init_fn):
        raise ConfigError(
            f"worker_init_fn {args.worker_init_fn!r} is not valid: expected a callable"
        )
    return shards
