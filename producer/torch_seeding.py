"""The global random generators a torch pipeline draws from, seeded per batch.

PyTorch pipelines draw their augmentations from process-wide generators: torchvision's
random transforms from torch's default generator, many user transforms from numpy's
global ``RandomState`` or Python's ``random``. A DataLoader worker seeds torch's from its
base seed and leaves the rest to the user; the batches it yields depend on which worker
built what. Served, any producer may build (or build again) any batch, so before each
batch the producer seeds all three from (the run's seed, the shard's seed, the batch's
position in its shard): the same batch gets the same draws wherever it is built.

What this cannot cover: a generator the user keeps in their own object (a
``torch.Generator`` or ``numpy.random.Generator`` attribute of a transform), which
carries its state from batch to batch inside one producer.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

import numpy as np

__all__ = ["batch_seed", "derive_seed", "preserved_rng", "seed_globals"]

# torch.manual_seed takes a 64-bit seed; keep to 63 bits so it is never negative.
_SEED_BITS = 63


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (their text forms)."""
    blob = ":".join(str(p) for p in parts).encode()
    digest = hashlib.sha256(blob).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


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
