"""DatasetStream's orders against real DataLoaders, epochs 0-2, for every sampler listed
in the issue; its arguments' checks; the collated batch's sources (no Redis here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import (  # noqa: E402
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from batchq.errors import BatchQueueError, ConfigError  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch import DatasetStream, loader_stream  # noqa: E402
from producer.torch.randomness import epoch_seed  # noqa: E402

N = 23
EPOCHS = 3


def dataset() -> Any:
    return TensorDataset(torch.arange(N), torch.arange(N) * 10)


def loader_epochs(loader: Any, epochs: int = EPOCHS) -> list[list[list[int]]]:
    """What a DataLoader yields, epoch after epoch: the index batches (source 0)."""
    out = []
    for _ in range(epochs):
        out.append([torch.atleast_1d(b[0]).tolist() for b in loader])
    return out


def stream_epochs(stream: Any, epochs: int = EPOCHS) -> list[list[list[int]]]:
    plan = ShardPlan(stream)
    got = []
    for e in range(epochs):
        batches = [b for s in range(plan.shards) for b in plan.iter_shard(e, s)]
        got.append([np.atleast_1d(b[0]).tolist() for b in batches])
    return got


def gen(seed: int = 7) -> Any:
    return torch.Generator().manual_seed(seed)


# Each case: the DataLoader's keyword arguments, built twice (fresh generators each).
CASES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "sequential": lambda ds: {"batch_size": 5},
    "sequential_sampler_drop_last": lambda ds: {
        "batch_size": 4,
        "sampler": SequentialSampler(ds),
        "drop_last": True,
    },
    "shuffle_generator": lambda ds: {"batch_size": 5, "shuffle": True, "generator": gen()},
    "random_replacement": lambda ds: {
        "batch_size": 3,
        "sampler": RandomSampler(ds, replacement=True, num_samples=17, generator=gen(3)),
    },
    "random_replacement_and_loader_generator": lambda ds: {
        "batch_size": 3,
        "sampler": RandomSampler(ds, replacement=True, num_samples=40, generator=gen(5)),
        "generator": gen(6),
    },
    "subset_random": lambda ds: {
        "batch_size": 4,
        "sampler": SubsetRandomSampler(list(range(2, 20, 2)), generator=gen(11)),
    },
    "weighted_random": lambda ds: {
        "batch_size": 4,
        "sampler": WeightedRandomSampler(
            torch.linspace(0.1, 1.0, N), num_samples=30, generator=gen(13)
        ),
    },
    "batch_sampler": lambda ds: {
        "batch_sampler": BatchSampler(RandomSampler(ds, generator=gen(17)), 6, drop_last=False),
    },
    "no_batching": lambda ds: {"batch_size": None, "shuffle": True, "generator": gen(19)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_epochs_0_to_2_are_the_dataloaders(case: str) -> None:
    ds = dataset()
    want = loader_epochs(DataLoader(ds, **CASES[case](ds)))
    assert stream_epochs(DatasetStream(ds, **CASES[case](ds))) == want
    # and from the DataLoader itself (what `batchq serve mod:make_loader` serves)
    assert stream_epochs(loader_stream(DataLoader(ds, **CASES[case](ds)))) == want


def test_any_epoch_is_computed_alone_and_again() -> None:
    ds = dataset()
    loader = DataLoader(ds, batch_size=5, shuffle=True, generator=gen())
    want = loader_epochs(loader, 40)
    orders = DatasetStream(ds, batch_size=5, shuffle=True, generator=gen()).orders
    for e in (37, 3, 16, 39, 0, 17, 37):  # out of order, past the kept states, again
        assert [b for b in orders.epoch(e)] == want[e]


def test_without_a_generator_epoch_e_is_the_loader_after_manual_seed() -> None:
    ds = dataset()
    got = stream_epochs(DatasetStream(ds, batch_size=5, shuffle=True, seed=4))
    want = []
    for e in range(EPOCHS):
        torch.manual_seed(epoch_seed(4, e))
        want += loader_epochs(DataLoader(ds, batch_size=5, shuffle=True), 1)
    assert got == want
    assert got[0] != got[1]  # each epoch its own order
    other = stream_epochs(DatasetStream(ds, batch_size=5, shuffle=True, seed=5))
    assert other != got


def test_persistent_workers_draw_the_base_seed_once() -> None:
    ds = dataset()
    kw: dict[str, Any] = {"batch_size": 5, "shuffle": True, "num_workers": 1}
    loader = DataLoader(ds, generator=gen(), persistent_workers=True, **kw)
    got = stream_epochs(loader_stream(loader))
    base = torch.empty((), dtype=torch.int64)
    g = gen()
    base.random_(generator=g)  # once, in the first iterator
    want = [
        [list(b) for b in BatchSampler(RandomSampler(ds, generator=g), 5, False)]
        for _ in range(EPOCHS)
    ]
    assert [[list(b) for b in e] for e in got] == want


def test_the_callers_generators_do_not_move_until_a_batch_is_built() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    before = torch.get_rng_state(), np.random.get_state()[1].copy()
    stream = DatasetStream(dataset(), batch_size=5, shuffle=True)
    plan = ShardPlan(stream)  # orders, the probe batch and the fingerprint
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1])
    list(plan.iter_shard(0, 0))  # building a batch seeds them: that is the point
    assert not torch.equal(torch.get_rng_state(), before[0])


class Reversed(Sampler[int]):
    """A sampler batchq knows nothing about: iterated (copied) in each producer."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs = 0

    def __iter__(self) -> Any:
        self.epochs += 1
        order = list(range(self.n))[::-1]
        return iter(order[self.epochs % 3 :] + order[: self.epochs % 3])

    def __len__(self) -> int:
        return self.n


def test_any_other_sampler_is_iterated_as_the_loader_iterates_it() -> None:
    ds = dataset()
    want = loader_epochs(DataLoader(ds, batch_size=4, sampler=Reversed(N)))
    assert stream_epochs(DatasetStream(ds, batch_size=4, sampler=Reversed(N))) == want


def test_the_fingerprint_tells_settings_apart() -> None:
    ds = dataset()

    def fp(**kw: Any) -> str:
        kw.setdefault("batch_size", 5)
        return ShardPlan(DatasetStream(ds, **kw)).fingerprint

    assert fp() == fp()
    assert fp(seed=2) != fp()  # the same plans, but other per-batch seeds
    assert fp(shuffle=True, generator=gen(1)) != fp(shuffle=True, generator=gen(2))
    assert fp(batch_size=4) != fp()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"batch_size": 0}, "batch_size 0 is not valid"),
        ({"batch_size": 2.5}, "batch_size 2.5 is not valid"),
        ({"shuffle": True, "sampler": [1, 2]}, "mutually exclusive with shuffle"),
        ({"batch_sampler": [[0, 1]], "batch_size": 3}, "batch_sampler option is mutually"),
        ({"batch_size": None, "drop_last": True}, "batch_size=None option"),
        ({"generator": 3}, "generator 3 is not valid"),
        ({"seed": -1}, "seed -1 is not valid"),
        ({"collate_fn": "stack"}, "collate_fn 'stack' is not valid"),
        ({"num_shards": 2}, "num_shards and worker_init_fn are for an IterableDataset"),
        ({"sources": "images"}, "sources 'images' is not valid"),
    ],
)
def test_bad_arguments_are_refused_as_dataloader_refuses_them(
    kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        DatasetStream(dataset(), **kw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, BatchQueueError)


def test_a_dataset_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected a map-style dataset"):
        DatasetStream(42)
    with pytest.raises(ConfigError, match="expected a torch DataLoader"):
        loader_stream([1, 2])


def test_an_empty_epoch_is_refused_when_the_sources_are_asked() -> None:
    stream = DatasetStream(dataset(), batch_size=30, drop_last=True)
    with pytest.raises(ConfigError, match="gives no batch in epoch 0"):
        _ = stream.sources
