"""A torch ``IterableDataset`` as a stream of ``num_shards`` shards per epoch.

A DataLoader with ``num_workers=N`` runs N copies of an IterableDataset's ``__iter__``,
each in a worker whose ``torch.utils.data.get_worker_info()`` says ``id`` and
``num_workers``, and the dataset's own code splits the data by them. Served, each epoch
has ``num_shards`` shards and shard i is such a worker: while it is built,
``get_worker_info()`` answers ``id=i, num_workers=num_shards`` (with a ``seed`` that is
a function of (seed, epoch, i), and the dataset), ``set_epoch(epoch)`` is called first
where the dataset has it, then ``worker_init_fn(i)`` where one is given. The shard's
examples are batched in order (``batch_size`` each, the last one short unless
``drop_last``, as a worker batches its own examples) and collated.

Every example comes exactly once per epoch when the dataset's split is deterministic:
each shard i yields the same examples wherever and whenever it is built. A shard whose
producer died, or a resume inside a shard, builds the shard again from its start (the
trainer drops, or the producer skips, the batches it had).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

from batchq.errors import ConfigError
from producer.randomness import derive_seed
from producer.streams import AbstractDataStream
from producer.torch.dataset import DatasetStream
from producer.torch.loader_args import LoaderArgs, check_iterable, check_seed
from producer.torch.randomness import batch_seed, seed_globals

__all__ = ["IterableDatasetStream"]


class _ShardScheme:
    """Epoch e's requests: its shards, as ``[e, i]``."""

    requests_examples = False

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards

    def get_request_iterator(self, epoch: int | None = None) -> Iterator[Any]:
        e = 0 if epoch is None else epoch
        return iter([[e, i] for i in range(self.num_shards)])


class _ShardRoot(AbstractDataStream):
    """The chain's root: its scheme's requests are the shards (the plan cuts there)."""

    def __init__(self, num_shards: int) -> None:
        super().__init__(iteration_scheme=_ShardScheme(num_shards))


@contextlib.contextmanager
def _as_worker(info: Any) -> Iterator[None]:
    """``get_worker_info()`` answers ``info`` inside the block."""
    from torch.utils.data._utils import worker

    saved = worker._worker_info
    worker._worker_info = info
    try:
        yield
    finally:
        worker._worker_info = saved


class IterableDatasetStream(DatasetStream):
    """An IterableDataset served as ``num_shards`` DataLoader workers' worth of shards.

    Args:
        dataset: a ``torch.utils.data.IterableDataset``.
        batch_size: examples per batch (None: each example is a batch).
        shuffle, sampler, batch_sampler, generator: refused, as DataLoader refuses them
            for an IterableDataset.
        drop_last: drop each shard's last, incomplete batch.
        collate_fn: as DataLoader's (default ``default_collate``).
        sources: names for the collated values (see :mod:`producer.torch.sources`).
        seed: the run's seed (default 1).
        num_shards: shards per epoch, the ``num_workers`` the dataset's split sees
            (default 1).
        worker_init_fn: called with the shard's id before the shard is iterated.
        torch_threads: torch's intra-op threads in a producer (see DatasetStream).

    Raises:
        ConfigError: an argument is invalid.
    """

    dataset_kind: ClassVar[str] = "iterable"
    #: Not one batch per request: the plan reads a shard's batches one ahead.
    one_to_one = False

    def _configure(self, args: LoaderArgs) -> None:
        """What an IterableDataset's stream makes of the arguments: ``num_shards``
        shards per epoch, each a DataLoader worker's share."""
        shards = check_iterable(args)
        self.seed = check_seed(args.seed)
        self.batch_size = args.batch_size
        self.num_shards = shards
        self.worker_init_fn = args.worker_init_fn
        self.sampler = None
        self.batch_sampler = None
        self.generator = None
        self.auto_collation = args.batch_size is not None
        self.data_stream = _ShardRoot(shards)
        AbstractDataStream.__init__(self, iteration_scheme=None)
        self._produces_examples = False

    @property
    def plan_fingerprint(self) -> dict[str, Any]:
        """What the plan's fingerprint adds for this stream (producers must agree)."""
        return {**super().plan_fingerprint, "num_shards": self.num_shards}

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """The batches of the shards the root's scheme names now (read at once: the
        shard plan swaps that scheme for one shard's request during this call)."""
        shards = list(self.data_stream.iteration_scheme.get_request_iterator())
        batches = (b for epoch, shard in shards for b in self._shard(epoch, shard))
        if as_dict:
            return (dict(zip(self.sources, b, strict=True)) for b in batches)
        return batches

    def get_data(self, request: Any = None) -> tuple[Any, ...]:
        """Not used: a shard's batches come from :meth:`get_epoch_iterator`."""
        raise ConfigError("an IterableDatasetStream is read through get_epoch_iterator")

    def _shard(self, epoch: int, shard: int) -> Iterator[tuple[Any, ...]]:
        layout = self.layout
        for batch in self._collated(epoch, shard, seeded=True):
            yield layout.values(batch)

    def _collated(self, epoch: int, shard: int, seeded: bool) -> Iterator[Any]:
        """Shard ``shard`` of ``epoch``'s collated batches, built as worker ``shard``."""
        from torch.utils.data._utils.worker import WorkerInfo

        info = WorkerInfo(
            id=shard,
            num_workers=self.num_shards,
            seed=derive_seed("worker", self.seed, epoch, shard),
            dataset=self.dataset,
        )
        k = 0
        if seeded:
            self._seed(epoch, shard, k)
        with _as_worker(info):
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            if self.worker_init_fn is not None:
                self.worker_init_fn(shard)
            examples = iter(self.dataset)
        size = self.batch_size or 1
        while True:
            if seeded and k:
                self._seed(epoch, shard, k)
            with _as_worker(info):  # the dataset's code may ask while it iterates
                chunk = list(itertools.islice(examples, size))
            if not chunk or (self.drop_last and len(chunk) < size):
                return
            yield self.collate_fn(chunk) if self.auto_collation else self.collate_fn(chunk[0])
            k += 1

    def _seed(self, epoch: int, shard: int, k: int) -> None:
        base = self._shard_seed if self._shard_seed is not None else derive_seed(epoch, shard)
        seed_globals(batch_seed(self.seed, base, k))

    def _probe_batch(self) -> Any:
        for shard in range(self.num_shards):  # seeded and restored by the caller
            for batch in self._collated(0, shard, seeded=False):
                return batch
        raise ConfigError(
            f"dataset {self.dataset!r} gives no batch in epoch 0 over {self.num_shards} "
            "shards: nothing to serve"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.dataset).__name__}, batch_size="
            f"{self.batch_size}, num_shards={self.num_shards}, seed={self.seed})"
        )
