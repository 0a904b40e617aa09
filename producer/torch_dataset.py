"""A torch map-style dataset as a stream: DataLoader's arguments, served by shards.

``DatasetStream(dataset, batch_size, shuffle, ...)`` takes a DataLoader's arguments with
their meaning and is the root of a pipeline :func:`producer.start_server` and ``batchq
serve`` serve. Its iteration scheme is :class:`~producer.torch_orders.SamplerOrders`:
epoch e's requests are the index batches the DataLoader yields in its (e+1)-th epoch,
a pure function of the sampler's settings and e, so the usual shard plan applies (one
shard per batch): shards, exactly-once delivery, ordered serving, resume and
data-parallel ranks work as for Fuel pipelines.

A batch is read as the DataLoader reads it: ``dataset.__getitems__(indices)`` where the
dataset has it (Hugging Face ``datasets.Dataset`` does, with its batch access), else
``[dataset[i] for i in indices]``, then ``collate_fn`` (default: torch's
``default_collate``; ``default_convert`` without batching). Before each batch the
producer seeds torch's, numpy's and Python's global generators from (seed, the shard's
seed, the batch's position) (:mod:`producer.torch_seeding`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from batchq.errors import ConfigError
from producer.streams import AbstractDataStream
from producer.torch_args import (
    LoaderArgs,
    check_batching,
    check_common,
    check_map_style,
    check_seed,
    check_threads,
    default_samplers,
)
from producer.torch_collate import SourceLayout
from producer.torch_flatten import flatten
from producer.torch_orders import SamplerOrders
from producer.torch_seeding import batch_seed, derive_seed, preserved_rng, seed_globals

__all__ = ["DatasetStream"]

log = logging.getLogger(__name__)


class DatasetStream(AbstractDataStream):
    """A torch dataset read as a DataLoader reads it, one shard per batch.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``, and
            ``__getitems__`` when it has one), or a ``torch.utils.data.IterableDataset``
            (then see :class:`producer.torch_iterable.IterableDatasetStream`).
        batch_size: examples per batch; None: no batching (each index is one batch,
            ``collate_fn`` defaults to ``default_convert``), as in DataLoader.
        shuffle: a ``RandomSampler(dataset, generator=generator)`` order.
        drop_last: drop the last, incomplete batch.
        collate_fn: builds a batch from a list of examples (default ``default_collate``).
        generator: a ``torch.Generator``: the DataLoader's generator (RandomSampler's
            permutations and the base seed are drawn from it, epoch after epoch).
        sampler: any torch sampler (mutually exclusive with ``shuffle``).
        batch_sampler: any batch sampler (mutually exclusive with ``batch_size``,
            ``shuffle``, ``sampler`` and ``drop_last``).
        sources: names for the collated batch's values (see
            :mod:`producer.torch_collate`); a dict batch is named by its keys.
        seed: the run's seed (default 1): the per-batch seeds of the global generators,
            and torch's global generator where a DataLoader would draw a fresh seed from
            it (shuffling without a generator: see :mod:`producer.torch_orders`).
        num_shards: an IterableDataset's shards per epoch (not for map-style datasets).
        worker_init_fn: an IterableDataset's ``worker_init_fn`` (not for map-style).
        torch_threads: torch's intra-op threads in a producer serving this stream (1,
            as in a DataLoader worker; None: torch's default).

    Raises:
        ConfigError: (a ValueError, as DataLoader raises) an argument is invalid or the
            combination is one DataLoader refuses.
    """

    def __new__(cls, dataset: Any, *args: Any, **kwargs: Any) -> DatasetStream:
        import torch.utils.data

        if cls is DatasetStream and isinstance(dataset, torch.utils.data.IterableDataset):
            from producer.torch_iterable import IterableDatasetStream

            return super().__new__(IterableDatasetStream)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[Any], Any] | None = None,
        generator: Any = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        sources: Sequence[str] | None = None,
        *,
        seed: int | None = None,
        num_shards: int | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
        torch_threads: int | None = 1,
    ) -> None:
        from torch.utils.data._utils.collate import default_collate, default_convert

        check_common(batch_size, collate_fn, sources)
        self.dataset = dataset
        self.drop_last = drop_last
        self._configure(
            LoaderArgs(
                dataset, batch_size, shuffle, drop_last, collate_fn, generator, sampler,
                batch_sampler, sources, seed, num_shards, worker_init_fn, torch_threads,
            )
        )  # fmt: skip
        self.collate_fn = collate_fn or (
            default_collate if self.auto_collation else default_convert
        )
        self._wanted_sources = None if sources is None else tuple(sources)
        self._layout: SourceLayout | None = None
        self._shard_seed: int | None = None
        self._k = 0
        self.torch_threads = check_threads(torch_threads)
        self._threads_set = False

    def _configure(self, args: LoaderArgs) -> None:
        """What a map-style dataset's stream makes of the arguments: DataLoader's
        samplers, their orders as the iteration scheme."""
        check_map_style(args.dataset, args.num_shards, args.worker_init_fn, args.generator)
        batch_size = check_batching(
            args.batch_size, args.shuffle, args.drop_last, args.sampler, args.batch_sampler
        )
        sampler, batch_sampler = default_samplers(
            args.dataset,
            batch_size,
            args.shuffle,
            args.drop_last,
            args.generator,
            args.sampler,
            args.batch_sampler,
        )
        self.seed = check_seed(args.seed)
        self.batch_size = batch_size
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = args.generator
        self.auto_collation = batch_sampler is not None
        self.orders = SamplerOrders(
            args.dataset,
            batch_sampler if self.auto_collation else sampler,
            args.generator,
            self.seed,
            batched=self.auto_collation,
        )
        AbstractDataStream.__init__(self, iteration_scheme=self.orders)

    # -- what the shard plan and the producer read -----------------------------------

    @property
    def sources(self) -> tuple[str, ...]:
        """The names of the collated batch's values (one probe batch tells them)."""
        return self.layout.sources

    @sources.setter
    def sources(self, value: tuple[str, ...]) -> None:
        raise ConfigError("a DatasetStream's sources come from its batches: pass sources=")

    @property
    def layout(self) -> SourceLayout:
        """The source layout, from a probe batch built on first use."""
        if self._layout is None:
            with preserved_rng():  # the caller's generators do not move
                seed_globals(derive_seed("probe", self.seed))
                batch = self._probe_batch()
            names, _ = flatten(batch)
            top_is_dict = isinstance(batch, Mapping)
            self._layout = SourceLayout(names, top_is_dict, self._wanted_sources)
        return self._layout

    @property
    def plan_fingerprint(self) -> dict[str, Any]:
        """What the plan's fingerprint adds for this stream (producers must agree).

        A dataset with a ``plan_name`` (:class:`producer.torch_cache.CachedDataset`:
        the dataset it wraps) is named by it: the cache is invisible to the plan, so
        turning it on keeps every shard's seed, and so every augmentation's draws.
        """
        return {
            "dataset": getattr(self.dataset, "plan_name", None) or type(self.dataset).__qualname__,
            "examples": self._examples(),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "collate_fn": getattr(self.collate_fn, "__qualname__", repr(self.collate_fn)),
            "sources": list(self.sources),
        }

    def reseed(self, seed: int) -> None:
        """Called by the producer before each shard: the shard's seed.

        The first call also gives torch one intra-op thread in this process, as a
        DataLoader worker does (``torch.set_num_threads(1)`` in its worker loop):
        producers are the workers, and on a host full of them each one's own thread
        pool only fights the others (measured: a batch of the image pipeline took 0.69 s
        on 2 loaded cores with 2 threads, 0.06 s with one). ``torch_threads`` says how
        many (None: leave torch's setting).
        """
        if not self._threads_set and self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)
        self._threads_set = True
        self._shard_seed = seed
        self._k = 0

    def get_data(self, request: Any = None) -> tuple[Any, ...]:
        """The batch of ``request`` (a list of indices; one index without batching)."""
        self._seed_batch()
        return self.layout.values(self._build(request))

    # -- building -----------------------------------------------------------------------

    def _seed_batch(self) -> None:
        if self._shard_seed is not None:  # served: the producer reseeded for the shard
            seed_globals(batch_seed(self.seed, self._shard_seed, self._k))
        self._k += 1

    def _build(self, request: Any) -> Any:
        if not self.auto_collation:
            return self.collate_fn(self.dataset[request])
        getitems = getattr(self.dataset, "__getitems__", None)
        # As torch's _MapDatasetFetcher reads a batch.
        data = getitems(request) if getitems else [self.dataset[i] for i in request]
        return self.collate_fn(data)

    def _probe_batch(self) -> Any:
        requests = self.orders.epoch(0)
        if not requests:
            raise ConfigError(
                f"dataset {self.dataset!r} gives no batch in epoch 0 (len {self._examples()}"
                f", batch_size {self.batch_size}, drop_last {self.drop_last}): nothing to serve"
            )
        return self._build(requests[0])

    def _examples(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def __repr__(self) -> str:
        order = getattr(self.batch_sampler, "sampler", self.sampler)  # what draws the order
        return (
            f"{type(self).__name__}({type(self.dataset).__name__}, batch_size="
            f"{self.batch_size}, sampler={type(order).__name__}, seed={self.seed})"
        )
