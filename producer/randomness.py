"""Where every random component of a pipeline gets its randomness.

Two regimes, chosen by the ``rng`` argument a scheme or a transformer is given:

* **Fuel's** (``rng`` a ``numpy.random.RandomState``): the component makes exactly the
  draws Fuel makes, from that RandomState, in Fuel's order. A shuffled scheme snapshots
  the RandomState at construction and replays it, so epoch ``e`` is Fuel's
  ``(e+1)``-th shuffle and can still be computed for any epoch directly
  (:class:`FuelShuffles`). A transformer draws from the caller's RandomState itself.
* **batchq's** (``rng`` None, an int seed or a ``numpy.random.Generator``): the
  component draws from ``numpy.random.default_rng([seed, salt])``.

Either way, when the producer builds a shard it calls ``reseed(seed)`` on each random
component with a seed derived from (the chain's fingerprint, epoch, shard, the
component's position in the chain) (:func:`component_seed`), so two components never
share a stream, even when both were left at ``rng=None``, and a shard built again
gives the same data. :func:`derive_seed` hashes any parts into a seed, for what draws
outside the chain (a torch pipeline's orders and batches: :mod:`producer.torch.randomness`;
a quarantined example's substitutes: :mod:`producer.quarantine`).
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import numpy as np

from producer.errors import ConfigError, RngError

__all__ = [
    "DEFAULT_SEED",
    "FuelShuffles",
    "RandomStateMixin",
    "RngLike",
    "chain_depth",
    "component_seed",
    "derive_seed",
    "seed_from_rng",
    "state_seed",
]

#: The seed used when ``rng`` is None (Fuel's ``config.default_seed``).
DEFAULT_SEED = 1
# Seeds drawn from a generator lie in [0, 2**32): valid for every numpy seeding API.
_SEED_BOUND = 2**32
# FuelShuffles keeps the RandomState of every _EVERY-th epoch.
_EVERY = 16
# torch.manual_seed takes a 64-bit seed; keep to 63 bits so it is never negative.
_SEED_BITS = 63

RngLike = int | np.integer | np.random.Generator | np.random.RandomState | None


def state_seed(rng: np.random.RandomState) -> int:
    """An int that identifies a RandomState's current state, without drawing from it."""
    name, keys, pos, has_gauss, cached = rng.get_state(legacy=True)
    blob = f"{name}:{pos}:{has_gauss}:{cached!r}:".encode() + np.asarray(keys).tobytes()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little")


def seed_from_rng(rng: RngLike) -> int:
    """Turn an ``rng`` argument into one non-negative int seed.

    Args:
        rng: ``None`` (:data:`DEFAULT_SEED`), an int seed >= 0, a numpy ``Generator``
            (one integer is drawn from it, so the caller's object is advanced once), or
            a ``RandomState`` (identified by its state: nothing is drawn from it, since
            Fuel's regime draws from it exactly as Fuel does).

    Returns:
        The seed.

    Raises:
        RngError: ``rng`` has another type.
        ConfigError: ``rng`` is a negative int.
    """
    if rng is None:
        return DEFAULT_SEED
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        if int(rng) < 0:
            raise ConfigError(f"rng={rng!r} is not valid: an int seed must be >= 0")
        return int(rng)
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(0, _SEED_BOUND))
    if isinstance(rng, np.random.RandomState):
        return state_seed(rng)
    raise RngError(
        f"rng={rng!r} (type {type(rng).__name__}) is not valid: expected None, an int "
        "seed >= 0, a numpy.random.Generator or a numpy.random.RandomState"
    )


def component_seed(shard_seed: int, position: int) -> int:
    """The seed of the component at ``position`` in the chain, for one shard."""
    state = np.random.SeedSequence([int(shard_seed), int(position)]).generate_state(1)
    return int(state[0])


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (their text forms): the seeds
    of a torch pipeline's batches and orders, and of a quarantined example's substitutes."""
    blob = ":".join(str(p) for p in parts).encode()
    digest = hashlib.sha256(blob).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def chain_depth(stream: Any) -> int:
    """How many ``data_stream`` links lie below ``stream`` (0 for a DataStream)."""
    depth = 0
    node = getattr(stream, "data_stream", None)
    while node is not None:
        depth += 1
        node = getattr(node, "data_stream", None)
    return depth


class FuelShuffles:
    """Fuel's successive shuffles of an index list, computable for any epoch.

    Fuel's shuffled schemes shuffle ``list(indices)`` in place with their RandomState
    once per epoch. This snapshots the RandomState at construction and replays it:
    :meth:`order` (epoch ``e``) is the ``(e+1)``-th shuffle. The state at the start of
    every 16th epoch computed so far is kept (2.5 KB each), and the latest one, so the
    next epoch costs one shuffle and any earlier one at most 16.

    The caller's RandomState is advanced by one shuffle, as Fuel's first epoch
    advances it, so the next component built from it (a transformer, another scheme)
    starts where it would start in Fuel.

    Args:
        rng: the caller's RandomState.
        count: the number of indices shuffled.
    """

    def __init__(self, rng: np.random.RandomState, count: int) -> None:
        self.count = count
        # The state at the start of epoch e, for e = 0 and every computed multiple of
        # _EVERY (memory stays small however many epochs run), plus the latest one.
        self._states: dict[int, Any] = {0: rng.get_state()}
        self._latest: tuple[int, Any] = (0, self._states[0])
        rng.shuffle(np.arange(count))

    def order(self, epoch: int) -> np.ndarray:
        """The positions ``0 .. count-1`` in the order of epoch ``epoch``."""
        start = max(e for e in self._states if e <= epoch)
        if self._latest[0] <= epoch and self._latest[0] > start:
            start, state = self._latest
        else:
            state = self._states[start]
        replay = np.random.RandomState()
        replay.set_state(state)
        for e in range(start, epoch):
            replay.shuffle(np.arange(self.count))
            if (e + 1) % _EVERY == 0:
                self._states[e + 1] = replay.get_state()
        self._latest = (epoch, replay.get_state())
        order = np.arange(self.count)
        replay.shuffle(order)
        return order


class RandomStateMixin:
    """Random state for transformers: ``self.rng``, set from ``rng``, reset by :meth:`reseed`.

    Assign the transformer's ``rng`` argument to ``self.rng`` (as Fuel's transformers
    do) and draw from ``self.rng``:

    * a ``RandomState`` is kept as is: the draws are Fuel's, in Fuel's order;
    * None, an int seed or a ``Generator`` give a ``numpy.random.Generator`` seeded from
      ``[seed, depth in the chain, branch under each Merge]`` (so two transformers left
      at None differ).

    The producer calls :meth:`reseed` before building each shard, with a seed unique to
    (chain, epoch, shard, position in the chain). Use :meth:`random_integers` and
    :meth:`uniform` to draw the same way from either kind of generator.

    Attributes:
        seed: the int this component's randomness derives from.
        fuel_rng: True when ``rng`` was a RandomState (Fuel's regime).
    """

    seed: int = DEFAULT_SEED
    fuel_rng: bool = False
    _rng: np.random.Generator | np.random.RandomState | None = None
    # Which input of each Merge above this component it lies under (outermost last):
    # set by Merge, so that components at the same depth of two branches differ.
    _branch: tuple[int, ...] = ()

    def under_branch(self, branch: int) -> None:
        """Record that this component lies under input ``branch`` of a Merge (called by
        Merge, innermost first), so that components at one depth of two branches draw
        from different streams."""
        self._branch = (branch, *self._branch)

    @property
    def rng(self) -> Any:
        """The generator this component draws from (a Generator or a RandomState)."""
        if self._rng is None:
            # Built at the first draw, when the chain below is known: salted by depth
            # (and by branch under a Merge).
            self._rng = np.random.default_rng([self.seed, chain_depth(self), *self._branch])
        return self._rng

    @rng.setter
    def rng(self, value: RngLike) -> None:
        self.seed = seed_from_rng(value)
        self.fuel_rng = isinstance(value, np.random.RandomState)
        self._rng = value if isinstance(value, np.random.RandomState) else None

    def _init_random_state(self, rng: RngLike) -> None:
        self.rng = rng

    def reseed(self, seed: int) -> None:
        """Reset the random state to a pure function of (``self.seed``, ``seed``).

        The producer calls this before building each (epoch, shard), so a shard that is
        built again yields the same data. The kind of generator is kept: a RandomState
        stays a RandomState (Fuel's draw methods), a Generator a Generator.

        Raises:
            ConfigError: ``seed`` is not an int >= 0.
        """
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ConfigError(f"reseed({seed!r}): expected an int >= 0")
        if self.fuel_rng:
            words = np.random.SeedSequence([self.seed, int(seed)]).generate_state(4)
            self._rng = np.random.RandomState(words)
        else:
            self._rng = np.random.default_rng([self.seed, int(seed)])

    def random_integers(self, low: int, high: int, size: int | None = None) -> Any:
        """Integers in ``[low, high]`` (both included), Fuel's ``random_integers``."""
        rng = self.rng
        if isinstance(rng, np.random.RandomState):
            # RandomState.random_integers(low, high) is randint(low, high + 1): the same
            # draws, without its deprecation warning.
            return rng.randint(low, high + 1, size=size)
        return rng.integers(low, high, size=size, endpoint=True)

    def uniform(self, low: float, high: float, size: int | None = None) -> Any:
        """Floats in ``[low, high)``."""
        return self.rng.uniform(low, high, size)
