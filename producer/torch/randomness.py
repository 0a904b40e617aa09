"""What a torch pipeline draws, made a pure function of the run's seed: the order of
each epoch's indices and the global generators' state before each batch.

**Seeds.** PyTorch pipelines draw their augmentations from process-wide generators:
torchvision's random transforms from torch's default generator, many user transforms
from numpy's global ``RandomState`` or Python's ``random``. A DataLoader worker seeds
torch's from its base seed and leaves the rest to the user; the batches it yields depend
on which worker built what. Served, any producer may build (or build again) any batch,
so before each batch the producer seeds all three from (the run's seed, the shard's
seed, the batch's position in its shard): the same batch gets the same draws wherever it
is built.

What this cannot cover: a generator the user keeps in their own object (a
``torch.Generator`` or ``numpy.random.Generator`` attribute of a transform), which
carries its state from batch to batch inside one producer.

**Orders.** A DataLoader's samplers keep state between epochs:
``RandomSampler(generator=g)`` draws a new permutation from ``g`` every epoch, and each
``iter(loader)`` also draws its base seed from the loader's generator first. Epoch e's
order therefore depends on the generator's state after e epochs. :class:`SamplerOrders`
snapshots the sampler (and the generators it holds) at construction and replays the
draws, so every producer computes epoch e's batches of indices alone, and they are
exactly those the DataLoader yields in its (e+1)-th epoch (as
:class:`producer.randomness.FuelShuffles` does for Fuel's schemes: the state before
every 16th computed epoch and the latest are kept).

Where a DataLoader would draw from torch's global generator (a ``RandomSampler`` or
``WeightedRandomSampler`` without a generator, the base seed of a loader without one),
it draws a fresh, unrepeatable seed each epoch. Here that generator is seeded with
``derive_seed('epoch', seed, e)`` (numpy's and ``random``'s too) while epoch e is
drawn: epoch e is what the DataLoader yields after ``torch.manual_seed(that seed)``,
the same in every producer. The caller's generators are restored afterwards.

Any sampler works the same way (its ``set_epoch(e)`` is called first where it has
one, as training loops do); one whose order is not a function of its state and the
epoch gives other indices in other producers, and producers refuse to share a run
whose plans differ (the plan's fingerprint: ``PipelineMismatch``).
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from producer.randomness import derive_seed

__all__ = ["SamplerOrders", "batch_seed", "epoch_seed", "preserved_rng", "seed_globals"]

# The state before every _EVERY-th epoch is kept (besides the latest).
_EVERY = 16


def batch_seed(seed: int, shard_seed: int, k: int) -> int:
    """The seed of batch ``k`` of the shard whose plan seed is ``shard_seed``.

    Args:
        seed: the run's seed (the stream's ``seed`` argument).
        shard_seed: what the producer passed to ``reseed`` for the shard (a hash of the
            pipeline's fingerprint, the epoch and the shard).
        k: the batch's position in its shard.
    """
    return derive_seed("batch", seed, shard_seed, k)


def seed_globals(seed: int) -> None:
    """Seed torch's default generator, numpy's global RandomState and ``random``."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # the global state is the point
    random.seed(seed)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block that reseeds the global generators, restoring their states after.

    Used where batchq draws in the caller's process (computing an epoch's order, the
    probe batch that names the sources): constructing a stream must not move the
    trainer's or the user's generators.
    """
    import torch

    torch_state = torch.get_rng_state()
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of torch's global generator while epoch ``epoch``'s order is drawn."""
    return derive_seed("epoch", seed, epoch)


def _plain(index: Any) -> Any:
    """An index (or a batch of them) as plain Python values: the plan is hashed as JSON."""
    if isinstance(index, bool):
        return index
    if isinstance(index, int | np.integer):
        return int(index)
    tolist = getattr(index, "tolist", None)
    if callable(tolist):  # a tensor or an array of indices
        return tolist()
    if isinstance(index, list | tuple):
        return [_plain(i) for i in index]
    return index


class SamplerOrders:
    """The iteration scheme of a map-style torch dataset: epoch e's index batches.

    Args:
        dataset: the dataset the sampler reads (never copied).
        index_sampler: what the DataLoader iterates: its batch sampler, or its sampler
            when it does not batch (``batch_size=None``).
        generator: the DataLoader's ``generator`` (its base seed is drawn from it every
            epoch), or None.
        seed: the run's seed (for the draws a DataLoader makes from torch's global
            generator).
        batched: whether each request is a list of indices (else one index).

    Raises:
        ConfigError: the sampler cannot be copied (its state must be, to replay it).
    """

    def __init__(
        self, dataset: Any, index_sampler: Any, generator: Any, seed: int, batched: bool
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.requests_examples = not batched
        #: False for a loader with persistent workers, which draws its base seed once.
        self.base_seed_each_epoch = True
        self._kept: dict[int, Any] = {0: self._copy((index_sampler, generator))}
        self._latest: tuple[int, Any] | None = None

    def draw_base_seed_once(self) -> None:
        """Draw the loader's base seed in epoch 0 only (``persistent_workers=True``)."""
        self.base_seed_each_epoch = False
        self._kept = {0: self._kept[0]}
        self._latest = None

    def get_request_iterator(self, epoch: int | None = None) -> Iterator[Any]:
        """The index batches of ``epoch`` (0 when None), in the DataLoader's order."""
        return iter(self.epoch(0 if epoch is None else epoch))

    def epoch(self, epoch: int) -> list[Any]:
        """Epoch ``epoch``'s requests: the (epoch+1)-th epoch of the DataLoader."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch {epoch!r} is not valid: expected an integer >= 0")
        state = self._state_before(epoch)
        requests = self._draw(state, epoch)
        self._latest = (epoch + 1, state)  # drawn: now the state before epoch + 1
        return requests

    def _copy(self, state: Any) -> Any:
        # The dataset stays shared (a sampler holds it as data_source): only the
        # sampler's own state and its generators are copied.
        try:
            return copy.deepcopy(state, {id(self.dataset): self.dataset})
        except Exception as e:
            raise ConfigError(
                f"sampler {state[0]!r} cannot be copied ({type(e).__name__}: {e}): batchq "
                "copies a sampler's state to compute any epoch's order in any producer"
            ) from e

    def _state_before(self, epoch: int) -> Any:
        start = max(k for k in self._kept if k <= epoch)
        source = self._kept[start]
        if self._latest is not None and start < self._latest[0] <= epoch:
            start, source = self._latest
        state = self._copy(source)
        for k in range(start, epoch):
            self._draw(state, k)
            if (k + 1) % _EVERY == 0 and k + 1 not in self._kept:
                self._kept[k + 1] = self._copy(state)
        return state

    def _draw(self, state: Any, epoch: int) -> list[Any]:
        """What one epoch of the DataLoader draws, in its order; advances ``state``."""
        import torch

        sampler, generator = state
        with preserved_rng():
            seed_globals(epoch_seed(self.seed, epoch))
            for target in (sampler, getattr(sampler, "sampler", None)):
                set_epoch = getattr(target, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
            if self.base_seed_each_epoch or epoch == 0:
                # _BaseDataLoaderIter.__init__: the base seed, before the first index.
                torch.empty((), dtype=torch.int64).random_(generator=generator)
            return [_plain(request) for request in sampler]
