"""Serve what PyTorch users already have: a Dataset, a DataLoader, an IterableDataset.

Needs the ``torch`` extra (``pip install batchq[torch]``); nothing else in producer/
imports this module (or torch).

* :class:`DatasetStream` takes a DataLoader's arguments (``batch_size``, ``shuffle``,
  ``drop_last``, ``collate_fn``, ``generator``, ``sampler``, ``batch_sampler``) and is
  a stream :func:`producer.start_server` and ``batchq serve`` serve; an
  ``IterableDataset`` is served as ``num_shards`` shards
  (:class:`~producer.torch.iterable.IterableDatasetStream`).
* :func:`loader_stream` turns a ``torch.utils.data.DataLoader`` into one (``batchq
  serve mod:make_loader`` does it for a factory that returns a DataLoader).
* :func:`cached` wraps a dataset's deterministic stage in an exact on-disk cache
  (:class:`DiskCache`), with the random ``augment`` after it (:mod:`producer.torch.cache`).
* :func:`import_torchvision` imports torchvision where its wheel's C++ ops cannot load
  beside this torch (:mod:`producer.torch.vision`).

The modules, one batch's way through them: a DataLoader's arguments and their checks
(:mod:`~producer.torch.loader_args`); the stream of a map-style dataset
(:mod:`~producer.torch.dataset`) or of an IterableDataset's shards
(:mod:`~producer.torch.iterable`); each epoch's order and the per-batch seeds of the
global generators (:mod:`~producer.torch.randomness`); the collated batch as the
frame's named sources (:mod:`~producer.torch.sources`). The cache: the cached Dataset
(:mod:`~producer.torch.cache`), an entry's bytes (:mod:`~producer.cache_entry`),
the directory (:mod:`~producer.cache_store`); its figures are summed for the
heartbeat by :mod:`producer.cache_stage`, outside this package so that a producer
without torch imports it.
"""

from __future__ import annotations

import logging
from typing import Any

from producer.cache_store import DiskCache
from producer.torch.cache import CachedDataset, cached
from producer.torch.dataset import DatasetStream
from producer.torch.iterable import IterableDatasetStream
from producer.torch.vision import import_torchvision

__all__ = [
    "CachedDataset",
    "DatasetStream",
    "DiskCache",
    "IterableDatasetStream",
    "as_stream",
    "cached",
    "import_torchvision",
    "loader_stream",
]

log = logging.getLogger(__name__)

# A DataLoader's settings that belong to the trainer's side, and their defaults.
_TRAINER_SIDE = {
    "num_workers": 0,
    "pin_memory": False,
    "prefetch_factor": None,
    "persistent_workers": False,
    "timeout": 0,
    "pin_memory_device": "",
    "multiprocessing_context": None,
}


def loader_stream(loader: Any, seed: int | None = None) -> DatasetStream:
    """A stream serving ``loader``'s dataset with its sampler, batch size, ``drop_last``,
    ``collate_fn`` and generator.

    Its ``num_workers``, ``pin_memory`` and ``prefetch_factor`` (and the other worker
    settings) belong to the trainer's side and are ignored, with one log line naming
    them: the producers are the workers (``batchq serve --workers N``). An
    IterableDataset is cut into ``max(1, num_workers)`` shards (the split its
    ``__iter__`` makes by worker info), and its ``worker_init_fn`` is called per shard.

    Args:
        loader: a ``torch.utils.data.DataLoader``.
        seed: the run's seed (see :class:`DatasetStream`).

    Raises:
        ConfigError: ``loader`` is not a DataLoader.
    """
    from torch.utils.data import DataLoader, IterableDataset

    from batchq.errors import ConfigError

    if not isinstance(loader, DataLoader):
        raise ConfigError(f"loader {loader!r} is not valid: expected a torch DataLoader")
    settings = {name: getattr(loader, name, default) for name, default in _TRAINER_SIDE.items()}
    log.info(
        "serving the DataLoader's dataset; ignored, they belong to the trainer's side "
        "(--workers is the number of producers): %s",
        ", ".join(
            f"{k}={v!r}" for k, v in settings.items() if k in _NAMED or v != _TRAINER_SIDE[k]
        ),
    )
    if isinstance(loader.dataset, IterableDataset):
        return IterableDatasetStream(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
            seed=seed,
            num_shards=max(1, loader.num_workers),
            worker_init_fn=loader.worker_init_fn,
        )
    batched = loader.batch_sampler is not None
    stream = DatasetStream(
        loader.dataset,
        batch_size=1 if batched else None,
        collate_fn=loader.collate_fn,
        generator=loader.generator,
        sampler=None if batched else loader.sampler,
        batch_sampler=loader.batch_sampler if batched else None,
        seed=seed,
    )
    if loader.persistent_workers and loader.num_workers > 0:
        stream.orders.draw_base_seed_once()  # its iterator is made once, its seed drawn once
    return stream


# Named in the log line whatever their values (the three).
_NAMED = ("num_workers", "pin_memory", "prefetch_factor")


def as_stream(obj: Any) -> Any:
    """``obj`` itself, or :func:`loader_stream` of it when it is a DataLoader."""
    from torch.utils.data import DataLoader

    return loader_stream(obj) if isinstance(obj, DataLoader) else obj
