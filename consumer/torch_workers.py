"""DataLoader workers around a TorchStream, refused before any worker process starts.

The producers are the workers and a queue has one trainer: a DataLoader with
``num_workers > 0`` would make each worker process a second trainer. The loaders that
hold a stream are found through the garbage collector's referrers (never by walking the
caller's frames), when the loader's iterator reads the dataset's ``__class__``.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from batchq.errors import ConfigError

__all__ = [
    "LOADER_SCAN_S",
    "DataLoaderWorkersError",
    "refuse_loader_workers",
    "refuse_worker_process",
]


# After a scan of the heap for DataLoaders holding a stream, how long only the loaders it
# found are looked at again (a loader's iterator asks several times in a row).
LOADER_SCAN_S = 1.0


class DataLoaderWorkersError(ConfigError):
    """A DataLoader with ``num_workers > 0`` around a TorchStream: the producers are the
    workers, and a queue has one trainer (a worker process would be a second one)."""


def _workers_error(num_workers: int) -> DataLoaderWorkersError:
    return DataLoaderWorkersError(
        f"DataLoader(num_workers={num_workers}) around a TorchStream: use num_workers=0. "
        "batchq's producers are the workers (start more with `batchq serve --workers N`); "
        "a DataLoader worker process would be a second trainer on the queue"
    )


def refuse_loader_workers(
    dataset: object, known: tuple[float, weakref.WeakSet[Any]] | None
) -> tuple[float, weakref.WeakSet[Any]]:
    """Raise if a DataLoader with workers holds ``dataset``; return the loaders found.

    Its iterator's base class checks ``isinstance(self._dataset, IterDataPipe)`` (in
    torch's DataLoader and torchdata's StatefulDataLoader alike) before the multi-process
    iterator starts a single worker, and isinstance reads ``__class__``: the error comes
    from there, at ``iter(loader)``. The loaders holding the dataset are found among the
    objects that refer to it (the garbage collector's public view of the heap), not by
    looking at the caller's frames. A scan costs time in proportion to the heap (15-30 ms
    for 200k objects), and a loader's construction and iteration ask several times: for
    LOADER_SCAN_S after a scan only the loaders it found are looked at again. (A loader
    made and iterated within that time is refused in its worker instead, at its first
    batch: :func:`refuse_worker_process`.)
    """
    now = time.monotonic()
    if known is None or now - known[0] >= LOADER_SCAN_S:
        found = (_loader_of(holder, dataset) for holder in gc.get_referrers(dataset))
        known = (now, weakref.WeakSet(loader for loader in found if loader is not None))
    loaders = known[1]
    for loader in list(loaders):
        # Only a loader being iterated: its own constructor's isinstance checks come
        # before it sets persistent_workers (its last public attribute).
        if loader.num_workers > 0 and _constructed(loader):
            for it in gc.get_referrers(dataset):
                _mark_shut(it, dataset)
            raise _workers_error(loader.num_workers)
    return known


def _mark_shut(holder: Any, dataset: object) -> None:
    """Mark the half-built iterator (it holds the dataset as ``_dataset``) shut.

    Its ``__del__`` reads ``_shutdown``, which our error comes before: without it the
    user sees a second traceback ("Exception ignored in __del__") after ours. The one
    private attribute of torch's this module writes (tests/consumer/test_torch.py fails
    if torch renames it).
    """
    attrs = getattr(holder, "__dict__", None)
    if isinstance(attrs, dict) and attrs.get("_dataset") is dataset and "_shutdown" not in attrs:
        attrs["_shutdown"] = True


def _constructed(loader: DataLoader[Any]) -> bool:
    return "persistent_workers" in vars(loader)


def _loader_of(holder: Any, dataset: object) -> DataLoader[Any] | None:
    """The DataLoader that ``holder`` is (or whose attribute dict it is), if it holds
    ``dataset`` (an object's attributes are its own referrer or its dict's, depending on
    whether Python materialised the dict)."""
    if isinstance(holder, DataLoader):
        return holder if vars(holder).get("dataset") is dataset else None
    if not isinstance(holder, dict) or holder.get("dataset") is not dataset:
        return None
    for owner in gc.get_referrers(holder):
        if isinstance(owner, DataLoader) and vars(owner) is holder:
            return owner
    return None


def refuse_worker_process() -> None:
    # The last line of defence (a DataLoader copy this module does not know).
    info = torch.utils.data.get_worker_info()
    if info is not None:
        raise _workers_error(info.num_workers)
