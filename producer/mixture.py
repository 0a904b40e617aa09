"""A mixture of datasets whose weights the trainer can change mid-run.

``Mixture(sources, weights, batch_size=..., batches_per_epoch=..., seed=...)`` is a
stream (serve it with ``start_server`` or ``batchq serve`` like any other) whose batch g
draws its examples from the sources by weight (``per='example'``), or draws one source
for the whole batch (``per='batch'``). Each source goes through its own shuffled order
without replacement and starts a new pass when it runs out; every batch says which
source each example came from (the source ``source_name``). The composition of batch g
is a pure function of (seed, g, the weights in effect at g), computable for any g
without building the batches before it (:class:`Draws`, below), so shards stay
independent and a resume is exact.

The weights are the constructor's until the trainer sets others::

    stream.set_params({"weights": {"web": 0.2, "books": 0.8}})

from the index that call returns on (:mod:`producer.control`: the mixture reads the
run's params log at its own batch numbers g = epoch * batches_per_epoch + i, which are
the run's global batch indices for a single trainer, and for ranks whose number divides
batches_per_epoch).

Sources are anything indexable with a length: a Fuel dataset (``num_examples``,
``get_data(state, request=[indices])``) or a sequence / torch-style map dataset
(``len`` and ``__getitem__``) whose examples are mappings (source name -> value),
named tuples, or tuples (values named by ``names``, default ``'0'``, ``'1'``...). Every
source must give the same source names.

**The draws** (:class:`Draws`), computed for any g without building anything. A
:class:`Mixture` numbers its batches ``g = epoch * batches_per_epoch + i``. For batch g:

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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from batchq.protocol.params_log import ParamsLog
from producer import control
from producer.datasets.base import Dataset
from producer.schemes import IterationScheme
from producer.streams import DataStream

__all__ = ["CHECKPOINT", "Draws", "Mixture", "MixtureDataset", "check_weights"]

PER = ("example", "batch")


def _count(value: Any, name: str) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name} {value!r} is not valid: expected an integer >= 1")
    return value


class _Source:
    """One mixture source read by example indices, as values by source name."""

    def __init__(self, name: str, dataset: Any, names: Sequence[str] | None) -> None:
        self.name = name
        self.dataset = dataset
        self.fuel = hasattr(dataset, "num_examples") and hasattr(dataset, "get_data")
        if self.fuel:
            self.size = int(dataset.num_examples)
            self.names: tuple[str, ...] = tuple(dataset.sources)
            self._state: Any = None
            self._opened = False
        elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            self.size = len(dataset)
            self.names = self._example_names(dataset[0], names) if self.size else ()
        else:
            raise ConfigError(
                f"source {name!r} ({type(dataset).__name__}) is not valid: expected a Fuel "
                "dataset (num_examples, get_data) or a sequence (len, __getitem__)"
            )
        if self.size < 1:
            raise ConfigError(f"source {name!r} is empty: expected at least one example")

    def _example_names(self, example: Any, names: Sequence[str] | None) -> tuple[str, ...]:
        if isinstance(example, Mapping):
            return tuple(str(k) for k in example)
        if isinstance(example, tuple) and hasattr(example, "_fields"):
            return tuple(example._fields)
        if isinstance(example, tuple | list):
            found = tuple(names) if names is not None else tuple(map(str, range(len(example))))
            if len(found) != len(example):
                raise ConfigError(
                    f"source {self.name!r}'s examples hold {len(example)} values, but names "
                    f"{list(found)} has {len(found)}: expected one name per value"
                )
            return found
        raise ConfigError(
            f"source {self.name!r}'s examples are {type(example).__name__}s: expected "
            "mappings of source names to values, named tuples or tuples"
        )

    def rows(self, indices: list[int]) -> list[tuple[Any, ...]]:
        """The examples at ``indices``, each a tuple in :attr:`names` order."""
        if self.fuel:
            if not self._opened:
                self._state, self._opened = self.dataset.open(), True
            data = self.dataset.get_data(self._state, request=list(indices))
            columns = [list(column) for column in data]
            return list(zip(*columns, strict=True))
        out = []
        for i in indices:
            example = self.dataset[i]
            if isinstance(example, Mapping):
                out.append(tuple(example[n] for n in self.names))
            else:
                out.append(tuple(example))
        return out


def _collate(values: list[Any]) -> Any:
    """Values of one source name as one array where they stack, else a list."""
    arrays = [np.asarray(v) for v in values]
    first = arrays[0]
    if first.dtype.kind in "biufcSUMm" and all(
        a.shape == first.shape and a.dtype == first.dtype for a in arrays
    ):
        return np.stack(arrays)
    return list(values)


class MixtureDataset(Dataset):
    """The dataset behind a :class:`Mixture`: request g is the mixture's batch g."""

    provides_sources: tuple[str, ...] | None = ("data",)  # replaced per instance below

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float],
        *,
        batch_size: int,
        seed: int,
        per: str,
        source_name: str,
        names: Sequence[str] | None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ConfigError(f"sources {sources!r} is not valid: expected a mapping name -> data")
        if per not in PER:
            raise ConfigError(f"per {per!r} is not valid: expected 'example' or 'batch'")
        if type(seed) is not int or seed < 0:
            raise ConfigError(f"seed {seed!r} is not valid: expected an integer >= 0")
        self.parts = [_Source(str(n), d, names) for n, d in sources.items()]
        self.part_names = tuple(p.name for p in self.parts)
        values = self.parts[0].names
        differ = {p.name: list(p.names) for p in self.parts if p.names != values}
        if differ:
            raise ConfigError(
                f"the sources give different source names ({self.parts[0].name!r}: "
                f"{list(values)}, {differ}): expected the same names from every source"
            )
        if not isinstance(source_name, str) or not source_name or source_name in values:
            raise ConfigError(
                f"source_name {source_name!r} is not valid: expected a name other than the "
                f"examples' sources {list(values)}"
            )
        self.value_names = values
        self.provides_sources = (*values, source_name)
        super().__init__()
        self.draws = Draws(
            self.part_names,
            [p.size for p in self.parts],
            check_weights(weights, self.part_names, "weights"),
            batch_size=_count(batch_size, "batch_size"),
            seed=seed,
            per=per,
        )

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Batch ``request`` (the mixture's batch number g), in :attr:`sources` order."""
        if type(request) is not int or request < 0:
            raise ConfigError(f"request {request!r} is not valid: expected a batch number g >= 0")
        g = request
        log = control.params_log()
        draws = self.draws
        counts, order = draws.composition(g, draws.weights_at(g, log))
        start = draws.before(g, log)
        rows: list[tuple[Any, ...]] = []
        labels: list[str] = []
        for s, part in enumerate(self.parts):
            if counts[s]:
                rows += part.rows(draws.examples(s, int(start[s]), int(counts[s])))
                labels += [part.name] * int(counts[s])
        placed = [rows[i] for i in order]
        columns = [_collate([row[c] for row in placed]) for c in range(len(self.value_names))]
        data = (*columns, np.array([labels[i] for i in order]))
        return self.filter_sources(data)


class _GlobalBatches(IterationScheme):
    """Epoch e's requests: the mixture's batch numbers e * batches_per_epoch + i."""

    requests_examples = False

    def __init__(self, batches_per_epoch: int) -> None:
        self.batches_per_epoch = batches_per_epoch

    def _epoch_requests(self, epoch: int) -> Iterator[int]:
        first = epoch * self.batches_per_epoch
        return iter(range(first, first + self.batches_per_epoch))

    def num_requests(self, epoch: int = 0) -> int:
        return self.batches_per_epoch


class Mixture(DataStream):
    """Batches drawn from several datasets by weight (see the module docstring).

    Args:
        sources: source name -> dataset (a Fuel dataset or a sequence).
        weights: source name -> weight (>= 0, not all 0; a source not named weighs 0),
            until the trainer sets ``{'weights': {...}}`` with ``set_params``.
        batch_size: examples per batch.
        batches_per_epoch: batches per epoch.
        seed: the seed of every draw.
        per: 'example' (each example drawn by weight) or 'batch' (one source per batch).
        source_name: the name of the source saying which source each example came from.
        names: the names of the values of tuple examples (default '0', '1', ...).

    Raises:
        ConfigError: naming the value and what was expected.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float],
        *,
        batch_size: int,
        batches_per_epoch: int,
        seed: int,
        per: str = "example",
        source_name: str = "source",
        names: Sequence[str] | None = None,
    ) -> None:
        dataset = MixtureDataset(
            sources, weights, batch_size=batch_size, seed=seed, per=per,
            source_name=source_name, names=names,
        )  # fmt: skip
        bpe = _count(batches_per_epoch, "batches_per_epoch")
        super().__init__(dataset, iteration_scheme=_GlobalBatches(bpe))
        # What producers must agree on beyond the plan (batchq adds it to the run's
        # fingerprint): another seed, size or weighting is another stream.
        self.plan_fingerprint = {
            "mixture": [list(dataset.part_names), [p.size for p in dataset.parts]],
            "weights": dataset.draws.weights.tolist(),
            "batch_size": batch_size,
            "seed": seed,
            "per": per,
            "sources": list(dataset.sources),
        }


# -- the draws ----------------------------------------------------------------

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
