"""A torch map-style dataset as a stream: DataLoader's arguments, served by shards.

``DatasetStream(dataset, batch_size, shuffle, ...)`` takes a DataLoader's arguments with
their meaning and is the root of a pipeline :func:`producer.start_server` and ``batchq
serve`` serve. Its iteration scheme is :class:`~producer.torch.randomness.SamplerOrders`:
epoch e's requests are the index batches the DataLoader yields in its (e+1)-th epoch,
a pure function of the sampler's settings and e, so the usual shard plan applies (one
shard per batch): shards, exactly-once delivery, ordered serving, resume and
data-parallel ranks work as for Fuel pipelines.

A batch is read as the DataLoader reads it: ``dataset.__getitems__(indices)`` where the
dataset has it (Hugging Face ``datasets.Dataset`` does, with its batch access), else
``[dataset[i] for i in indices]``, then ``collate_fn`` (default: torch's
``default_collate``; ``default_convert`` without batching). Before each batch the
producer seeds torch's, numpy's and Python's global generators from (seed, the shard's
seed, the batch's position) (:mod:`producer.torch.randomness`).

With ``on_sample_error='quarantine'`` an example whose read raises is recorded and
replaced by a substitute drawn from (seed, epoch, index), so the batch keeps its size
(:mod:`producer.quarantine`): a batch read by ``__getitems__`` that raises is read again
example by example, from the batch's seed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from batchq.errors import ConfigError
from producer.isolation import ChildReader
from producer.quarantine import DEFAULT_MAX_QUARANTINED, SampleErrors, check_sample_errors
from producer.randomness import derive_seed
from producer.streams import AbstractDataStream
from producer.torch.loader_args import (
    LoaderArgs,
    check_batching,
    check_common,
    check_map_style,
    check_seed,
    check_threads,
    default_samplers,
)
from producer.torch.randomness import SamplerOrders, batch_seed, preserved_rng, seed_globals
from producer.torch.sources import SourceLayout, flatten

__all__ = ["DatasetStream"]

log = logging.getLogger(__name__)


class DatasetStream(AbstractDataStream):
    """A torch dataset read as a DataLoader reads it, one shard per batch.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``, and
            ``__getitems__`` when it has one), or a ``torch.utils.data.IterableDataset``
            (then see :class:`producer.torch.iterable.IterableDatasetStream`).
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
            :mod:`producer.torch.sources`); a dict batch is named by its keys.
        seed: the run's seed (default 1): the per-batch seeds of the global generators,
            and torch's global generator where a DataLoader would draw a fresh seed from
            it (shuffling without a generator: see :mod:`producer.torch.randomness`).
        num_shards: an IterableDataset's shards per epoch (not for map-style datasets).
        worker_init_fn: an IterableDataset's ``worker_init_fn`` (not for map-style).
        torch_threads: torch's intra-op threads in a producer serving this stream (1,
            as in a DataLoader worker; None: torch's default).
        on_sample_error: 'raise' (default: the batch's build raises, the shard is
            retried and reported as ProducerFailed after max_attempts) or 'quarantine'
            (a map-style dataset: the example is recorded and replaced by a
            substitute, see :mod:`producer.quarantine`).
        max_quarantined: with 'quarantine', the most examples that may be quarantined,
            a fraction of an epoch's examples (default 0.01): more is QuarantineExceeded
            (ProducerFailed to the trainer) naming them.

    Raises:
        ConfigError: (a ValueError, as DataLoader raises) an argument is invalid or the
            combination is one DataLoader refuses.
    """

    #: The kind of dataset the class serves. ``DatasetStream(dataset)`` is the one
    #: constructor of both kinds: given an IterableDataset it makes its subclass of kind
    #: 'iterable' (:class:`producer.torch.iterable.IterableDatasetStream`, defined where
    #: the package imports it), found among its subclasses so that this module does not
    #: import that one, which builds on this one.
    dataset_kind: ClassVar[str] = "map-style"

    def __new__(cls, dataset: Any, *args: Any, **kwargs: Any) -> DatasetStream:
        import torch.utils.data

        if cls is DatasetStream and isinstance(dataset, torch.utils.data.IterableDataset):
            (iterable,) = [k for k in cls.__subclasses__() if k.dataset_kind == "iterable"]
            return super().__new__(iterable)
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
        on_sample_error: str = "raise",
        max_quarantined: float = DEFAULT_MAX_QUARANTINED,
    ) -> None:
        from torch.utils.data._utils.collate import default_collate, default_convert

        check_common(batch_size, collate_fn, sources)
        check_sample_errors(on_sample_error, max_quarantined)
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
        self._epoch = 0  # the epoch of the shard built (begin_shard); in-process: 0
        # What the stream reads now, as given: formatted only when a build past
        # build_timeout_s names it (:attr:`reading`), not for every example.
        self._reading: tuple[str, Any] | None = None
        self._batch_seed: int | None = None
        # Set for a shard whose earlier attempt failed: each example is read in a forked
        # child first, for at most _isolate_timeout_s (producer.isolation).
        self._isolated = False
        self._isolate_timeout_s: float | None = None
        self._child: ChildReader | None = None  # the child of the isolated reads
        self.sample_errors: SampleErrors | None = None
        self._sample_settings = ("raise", DEFAULT_MAX_QUARANTINED)
        self.set_sample_errors(on_sample_error, max_quarantined)

    def set_sample_errors(self, on_sample_error: str | None, max_quarantined: float | None) -> None:
        """What a read that raises does (see the class's arguments; None keeps the
        current value). Set before the stream is served: the plan's fingerprint names it.

        Raises:
            ConfigError: an invalid value, or quarantine asked of an iterable dataset.
        """
        mode = on_sample_error or self._sample_settings[0]
        fraction = self._sample_settings[1] if max_quarantined is None else max_quarantined
        check_sample_errors(mode, fraction)
        self._sample_settings = (mode, fraction)
        if mode == "raise":
            self.sample_errors = None  # the build raises, as it always did
            return
        if not isinstance(getattr(self, "orders", None), SamplerOrders):
            raise ConfigError(
                f"on_sample_error='quarantine' given for {type(self.dataset).__name__}: "
                "expected a map-style dataset (an iterable one has no example to replace)"
            )
        examples = self._examples() or 0
        epoch_examples = sum(len(r) if isinstance(r, list) else 1 for r in self.orders.epoch(0))
        self.sample_errors = SampleErrors(mode, fraction, self.seed, examples, epoch_examples)

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
        """What the plan's fingerprint adds for this stream (producers must agree; a
        stream that quarantines says so: its batches hold substitutes).

        A dataset with a ``plan_name`` (:class:`producer.torch.cache.CachedDataset`:
        the dataset it wraps) is named by it: the cache is invisible to the plan, so
        turning it on keeps every shard's seed, and so every augmentation's draws.
        """
        out = {
            "dataset": getattr(self.dataset, "plan_name", None) or type(self.dataset).__qualname__,
            "examples": self._examples(),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "collate_fn": getattr(self.collate_fn, "__qualname__", repr(self.collate_fn)),
            "sources": list(self.sources),
        }
        if self._quarantines:
            out["on_sample_error"] = "quarantine"
        return out

    def begin_shard(self, epoch: int, shard: int) -> None:
        """Called by the producer before each shard (before reseed): its address."""
        self._epoch = epoch

    def isolate(self, on: bool, timeout_s: float | None = None) -> bool:
        """Read each example in a forked child first (``on``; the producer sets it for a
        shard whose earlier attempt failed, :mod:`producer.isolation`): an example whose
        read kills the child or takes more than ``timeout_s`` raises ExampleKilled where
        its read would have raised (quarantined like an error, or the build fails).
        Returns whether the shard is built isolated."""
        self._isolated, self._isolate_timeout_s = on, timeout_s
        if not on and self._child is not None:
            self._child.close()  # forked again for the next isolated shard
            self._child = None
        return on

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
        self._batch_seed = None
        if self._shard_seed is not None:  # served: the producer reseeded for the shard
            self._batch_seed = batch_seed(self.seed, self._shard_seed, self._k)
            seed_globals(self._batch_seed)
        self._k += 1

    @property
    def _quarantines(self) -> bool:
        errors = getattr(self, "sample_errors", None)
        return errors is not None and errors.quarantine

    def _build(self, request: Any) -> Any:
        errors = self.sample_errors
        if errors is not None and errors.quarantine:
            data = self._read_quarantined(request, errors)
            self._reading = None
            return self.collate_fn(data)
        if not self.auto_collation:
            return self.collate_fn(self._get(request))
        getitems = getattr(self.dataset, "__getitems__", None)
        # As torch's _MapDatasetFetcher reads a batch (isolated: example by example).
        if getitems and not self._isolated:
            self._reading = ("examples", request)
            data = getitems(request)
        else:
            data = [self._get(i) for i in request]
        self._reading = None
        return self.collate_fn(data)

    @property
    def reading(self) -> str:
        """What the stream reads now ('example 17', 'examples [3, 4]'; '' between
        batches): a build past build_timeout_s names it."""
        what = self._reading
        if what is None:
            return ""
        kind, which = what
        return f"{kind} {list(which) if kind == 'examples' else which}"

    def _get(self, i: Any) -> Any:
        """``dataset[i]``, saying so (:attr:`reading`); isolated, read in a forked child
        first (ExampleKilled where that child died or hung)."""
        self._reading = ("example", i)
        if self._isolated:
            if self._child is None:
                self._child = ChildReader(self.dataset.__getitem__)
            self._child.try_read(i, f"example {i}", self._isolate_timeout_s)
        return self.dataset[i]

    def _read_quarantined(self, request: Any, errors: SampleErrors) -> Any:
        """The batch's examples, an example that raises replaced by its substitute."""
        epoch = self._epoch

        def read(i: int) -> Any:
            return errors.read(self._get, i, epoch, seed_globals)

        if not self.auto_collation:
            return read(request)
        getitems = getattr(self.dataset, "__getitems__", None)
        clean = not errors.known_bad.intersection(request)
        if getitems and clean and not self._isolated:
            try:
                self._reading = ("examples", request)
                return getitems(request)
            except Exception:
                # Read again example by example, from the batch's seed: an example that
                # raises is found and replaced (the same way in every producer).
                if self._batch_seed is not None:
                    seed_globals(self._batch_seed)
        return [read(i) for i in request]

    def _probe_batch(self) -> Any:
        requests = self.orders.epoch(0)
        if not requests:
            raise ConfigError(
                f"dataset {self.dataset!r} gives no batch in epoch 0 (len {self._examples()}"
                f", batch_size {self.batch_size}, drop_last {self.drop_last}): nothing to serve"
            )
        request = requests[0]
        if self.auto_collation:
            # Its first example collated names the sources as the whole batch does, at a
            # batch_size-th of the cost: `batchq serve` builds the probe before it forks
            # its workers, on the first batch's path (issue 40).
            request = request[:1]
        return self._build(request)

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
