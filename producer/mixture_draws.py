"""What a mixture draws for batch g, computed for any g without building anything.

A :class:`producer.mixture.Mixture` numbers its batches ``g = epoch * batches_per_epoch
+ i``. For batch g:

* the weights ``w(g)``: ``params_at(g)['weights']`` where the run's params log
  (:mod:`batchq.protocol.params_log`) set weights at or before g, else the mixture's
  own; a source the weights do not name weighs 0;
* the composition, from ``numpy.random.default_rng([seed, g])``: per example, the
  counts of each source ``Multinomial(batch_size, w(g))`` then the order of the batch's
  positions (a permutation); per batch, one source drawn by weight;
* the examples: each source s goes through its own shuffled order without replacement,
  pass p being ``default_rng([seed, hash(s), p]).permutation(len(s))``; batch g takes
  the next ``count_s(g)`` positions of that endless sequence after the cumulative count
  of s over the batches before g.

The cumulative counts are kept at checkpoints every :data:`CHECKPOINT` batches (each
computed once from the one before), so the batch at any g costs at most that many
draws, and a change of the weights from index i on only recomputes the checkpoints
after i.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from batchq.protocol.params_log import ParamsLog

__all__ = ["CHECKPOINT", "Draws", "check_weights"]

CHECKPOINT = 256  # batches between two kept cumulative counts
_PERMUTATIONS = 4  # per source: the passes whose orders are kept


def check_weights(weights: Any, names: Sequence[str], what: str) -> np.ndarray:
    """Weights as a normalised vector over ``names`` (a missing name weighs 0).

    Raises:
        ConfigError: not a mapping, an unknown source, a weight that is not a number
            >= 0, or all zero; naming them (``what``: where they came from).
    """
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{what} {weights!r} is not valid: expected a mapping source -> weight")
    unknown = sorted(str(k) for k in weights if k not in names)
    if unknown:
        raise ConfigError(
            f"{what} name the sources {unknown}, which the mixture does not have; its "
            f"sources are {list(names)}"
        )
    out = np.zeros(len(names))
    for i, name in enumerate(names):
        value = weights.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{what}[{name!r}] = {value!r} is not valid: expected a number")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what}[{name!r}] = {value!r} is not valid: expected >= 0")
        out[i] = value
    if out.sum() <= 0:
        raise ConfigError(f"{what} {dict(weights)!r} are all zero: expected one above 0")
    normalised: np.ndarray = out / out.sum()
    return normalised


def _name_seed(name: str) -> int:
    """A stable seed for a source's name (Python's hash() changes between processes)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


class Draws:
    """A mixture's draws (see the module docstring).

    Args:
        names: the sources, in order.
        sizes: each source's number of examples.
        weights: the mixture's own weights (normalised, in ``names`` order).
        batch_size: examples per batch.
        seed: the mixture's seed.
        per: 'example' or 'batch'.
    """

    def __init__(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        weights: np.ndarray,
        *,
        batch_size: int,
        seed: int,
        per: str,
    ) -> None:
        self.names = tuple(names)
        self.sizes = tuple(sizes)
        self.weights = weights
        self.batch_size = batch_size
        self.seed = seed
        self.per = per
        self._name_seeds = tuple(_name_seed(n) for n in self.names)
        self._schedule: tuple[tuple[int, str], ...] = ()  # the log's weight entries
        self._cum: dict[int, np.ndarray] = {0: np.zeros(len(self.names), dtype=np.int64)}
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def weights_at(self, g: int, log: ParamsLog) -> np.ndarray:
        """w(g): the log's weights in effect at g, else the mixture's own."""
        values = log.params_at(g)
        if "weights" not in values:
            return self.weights
        return check_weights(values["weights"], self.names, f"params['weights'] at batch {g}")

    def composition(self, g: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(count per source, the batch's order of positions) of batch g."""
        rng = np.random.default_rng([self.seed, g])
        if self.per == "batch":
            counts = np.zeros(len(self.names), dtype=np.int64)
            counts[rng.choice(len(self.names), p=weights)] = self.batch_size
            return counts, np.arange(self.batch_size)
        counts = rng.multinomial(self.batch_size, weights).astype(np.int64)
        return counts, rng.permutation(self.batch_size)

    def _follow(self, log: ParamsLog) -> None:
        """Forget the checkpoints a change of the log's weights made wrong."""
        schedule = tuple(
            (e.index, repr(e.params["weights"])) for e in log.entries if "weights" in e.params
        )
        if schedule == self._schedule:
            return
        changed = set(schedule) ^ set(self._schedule)
        first = min(index for index, _ in changed)
        self._schedule = schedule
        self._cum = {c: v for c, v in self._cum.items() if c * CHECKPOINT <= first}

    def before(self, g: int, log: ParamsLog) -> np.ndarray:
        """The cumulative count of each source over the batches before g."""
        self._follow(log)
        c = g // CHECKPOINT
        known = max(k for k in self._cum if k <= c)
        cum = self._cum[known].copy()
        for j in range(known * CHECKPOINT, g):
            if j % CHECKPOINT == 0 and j // CHECKPOINT not in self._cum:
                self._cum[j // CHECKPOINT] = cum.copy()
            cum += self.composition(j, self.weights_at(j, log))[0]
        if g % CHECKPOINT == 0:
            self._cum[c] = cum.copy()
        return cum

    def _order(self, s: int, p: int) -> np.ndarray:
        """Source s's order in its pass p (a few kept)."""
        key = (s, p)
        order = self._perms.get(key)
        if order is None:
            rng = np.random.default_rng([self.seed, self._name_seeds[s], p])
            order = rng.permutation(self.sizes[s])
            self._perms[key] = order
            if len(self._perms) > _PERMUTATIONS * len(self.names):
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return order

    def examples(self, s: int, start: int, count: int) -> list[int]:
        """Source s's examples at positions start .. start + count - 1 of its passes."""
        out = []
        size = self.sizes[s]
        for pos in range(start, start + count):
            p, offset = divmod(pos, size)
            out.append(int(self._order(s, p)[offset]))
        return out
