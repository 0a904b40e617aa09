"""Tests of producer.schemes: Fuel's request formats, and per-epoch determinism."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.errors import BatchSizeError, ConfigError, RngError, SchemeError
from producer.schemes import (
    DEFAULT_SEED,
    BatchScheme,
    BatchSizeScheme,
    ConcatenatedScheme,
    ConstantScheme,
    IndexScheme,
    IterationScheme,
    SequentialExampleScheme,
    SequentialScheme,
    ShuffledExampleScheme,
    ShuffledScheme,
    cross_validation,
    seed_from_rng,
)

SETTINGS = settings(max_examples=60, deadline=None)


def flatten(requests: list) -> list[int]:
    return [i for r in requests for i in (r if isinstance(r, list) else [r])]


# --- Fuel's documented examples ------------------------------------------------------


def test_fuel_overview_sequential_schemes() -> None:
    assert list(SequentialScheme(examples=8, batch_size=5).get_request_iterator()) == [
        [0, 1, 2, 3, 4],
        [5, 6, 7],
    ]
    assert list(SequentialExampleScheme(examples=8).get_request_iterator()) == list(range(8))


def test_shuffled_schemes_fixed_values() -> None:
    # Written out so that a change of the shuffling algorithm (which would change every
    # run's data order) is caught. Fuel's values differ: it used RandomState.shuffle.
    assert list(ShuffledScheme(examples=8, batch_size=3).get_request_iterator()) == [
        [5, 0, 1],
        [4, 2, 6],
        [3, 7],
    ]
    assert list(ShuffledScheme(8, 3).get_request_iterator(epoch=1)) == [
        [6, 1, 4],
        [0, 3, 2],
        [5, 7],
    ]
    assert list(ShuffledExampleScheme(examples=8).get_request_iterator()) == [
        5,
        0,
        1,
        4,
        2,
        6,
        3,
        7,
    ]


def test_request_kinds() -> None:
    assert SequentialScheme(4, 2).requests_examples is False
    assert ShuffledScheme(4, 2).requests_examples is False
    assert ConstantScheme(2).requests_examples is False
    assert SequentialExampleScheme(4).requests_examples is True
    assert ShuffledExampleScheme(4).requests_examples is True
    assert isinstance(ConstantScheme(2), BatchSizeScheme)
    assert isinstance(SequentialScheme(4, 2), BatchScheme)
    assert isinstance(SequentialExampleScheme(4), IndexScheme)


# --- coverage and determinism (hypothesis) -------------------------------------------


@SETTINGS
@given(n=st.integers(0, 300), batch_size=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_batch_schemes_cover_each_example_once_per_epoch(
    n: int, batch_size: int, seed: int
) -> None:
    for scheme in (SequentialScheme(n, batch_size), ShuffledScheme(n, batch_size, rng=seed)):
        for epoch in range(3):
            requests = list(scheme.get_request_iterator(epoch=epoch))
            assert sorted(flatten(requests)) == list(range(n))
            assert len(requests) == scheme.num_requests(epoch) == -(-n // batch_size)
            assert all(len(r) == batch_size for r in requests[:-1])
            assert all(0 < len(r) <= batch_size for r in requests)


@SETTINGS
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_example_schemes_cover_each_example_once_per_epoch(n: int, seed: int) -> None:
    for scheme in (SequentialExampleScheme(n), ShuffledExampleScheme(n, rng=seed)):
        for epoch in range(3):
            requests = list(scheme.get_request_iterator(epoch=epoch))
            assert sorted(requests) == list(range(n))
            assert all(type(r) is int for r in requests)
            assert scheme.num_requests(epoch) == n


@SETTINGS
@given(
    n=st.integers(1, 200),
    batch_size=st.integers(1, 32),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 50),
    history=st.integers(0, 5),
)
def test_epoch_requests_are_pure_functions_of_seed_and_epoch(
    n: int, batch_size: int, seed: int, epoch: int, history: int
) -> None:
    fresh = list(ShuffledScheme(n, batch_size, rng=seed).get_request_iterator(epoch=epoch))
    used = ShuffledScheme(n, batch_size, rng=seed)
    for _ in range(history):  # iterate other epochs first: must not matter
        list(used.get_request_iterator())
    list(used.get_request_iterator(epoch=epoch + 1))
    assert list(used.get_request_iterator(epoch=epoch)) == fresh
    examples = ShuffledExampleScheme(n, rng=seed)
    for _ in range(history):
        list(examples.get_request_iterator())
    assert list(examples.get_request_iterator(epoch=epoch)) == flatten(
        [list(ShuffledExampleScheme(n, rng=seed).permutation(epoch))]
    )


def test_epoch_none_counts_epochs_and_explicit_epochs_do_not_move_the_counter() -> None:
    scheme = ShuffledScheme(50, 7, rng=3)
    reference = ShuffledScheme(50, 7, rng=3)
    assert list(scheme.get_request_iterator()) == list(reference.get_request_iterator(epoch=0))
    list(scheme.get_request_iterator(epoch=9))
    assert list(scheme.get_request_iterator()) == list(reference.get_request_iterator(epoch=1))
    assert list(scheme.get_request_iterator()) == list(reference.get_request_iterator(epoch=2))


def test_shuffled_epochs_differ_and_seeds_differ() -> None:
    scheme = ShuffledScheme(100, 10, rng=5)
    epochs = [list(scheme.get_request_iterator(epoch=e)) for e in range(4)]
    assert all(a != b for a, b in itertools.combinations(epochs, 2))
    other = list(ShuffledScheme(100, 10, rng=6).get_request_iterator(epoch=0))
    assert other != epochs[0]
    examples = ShuffledExampleScheme(100)
    assert list(examples.get_request_iterator(epoch=0)) != list(
        examples.get_request_iterator(epoch=1)
    )


def test_sorted_indices_sorts_within_batches_only() -> None:
    plain = list(ShuffledScheme(40, 8, rng=2).get_request_iterator(epoch=0))
    ordered = list(ShuffledScheme(40, 8, rng=2, sorted_indices=True).get_request_iterator(epoch=0))
    assert ordered == [sorted(b) for b in plain]
    assert ordered != plain


def test_examples_as_a_list_of_indices() -> None:
    assert list(SequentialScheme([3, 1, 4, 1], 3).get_request_iterator()) == [[3, 1, 4], [1]]
    assert list(SequentialExampleScheme(np.array([7, 2])).get_request_iterator()) == [7, 2]
    scheme = ShuffledScheme([10, 20, 30, 40, 50], 2, rng=0)
    assert sorted(flatten(list(scheme.get_request_iterator()))) == [10, 20, 30, 40, 50]
    assert sorted(ShuffledExampleScheme(range(5, 9)).get_request_iterator()) == [5, 6, 7, 8]
    assert scheme.num_examples == 5


# --- seeds and rng -------------------------------------------------------------------


def test_seed_from_rng_accepts_fuel_and_numpy_generators() -> None:
    assert seed_from_rng(None) == DEFAULT_SEED == ShuffledScheme(4, 2).seed == 1
    assert seed_from_rng(42) == 42
    assert seed_from_rng(np.int64(7)) == 7
    assert seed_from_rng(np.random.default_rng(0)) == seed_from_rng(np.random.default_rng(0))
    assert seed_from_rng(np.random.RandomState(0)) == seed_from_rng(np.random.RandomState(0))
    a = ShuffledScheme(30, 4, rng=np.random.RandomState(123))
    b = ShuffledScheme(30, 4, rng=np.random.RandomState(123))
    assert a.seed == b.seed
    assert list(a.get_request_iterator(epoch=3)) == list(b.get_request_iterator(epoch=3))
    assert SequentialScheme(4, 2).seed is None


@pytest.mark.parametrize("rng", ["seed", 1.5, True, object()])
def test_bad_rng_types_raise(rng: object) -> None:
    with pytest.raises(RngError, match="rng=") as info:
        ShuffledScheme(4, 2, rng=rng)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)


def test_negative_seed_raises() -> None:
    with pytest.raises(ConfigError, match="-3"):
        ShuffledExampleScheme(4, rng=-3)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "3", None, True])
def test_bad_batch_sizes_raise_naming_the_value(batch_size: object) -> None:
    for build in (
        lambda: SequentialScheme(10, batch_size),  # type: ignore[arg-type]
        lambda: ShuffledScheme(10, batch_size),  # type: ignore[arg-type]
        lambda: ConstantScheme(batch_size),  # type: ignore[arg-type]
    ):
        with pytest.raises(BatchSizeError, match=f"batch_size={batch_size!r}") as info:
            build()
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("examples", [-1, "abc", 2.5, [0.5, 1.5], [-1, 2]])
def test_bad_examples_raise(examples: object) -> None:
    with pytest.raises(ConfigError):
        SequentialScheme(examples, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("epoch", [-1, 1.0, "0", True])
def test_bad_epochs_raise(epoch: object) -> None:
    with pytest.raises(ConfigError, match="epoch="):
        SequentialScheme(4, 2).get_request_iterator(epoch=epoch)  # type: ignore[arg-type]


# --- ConstantScheme ------------------------------------------------------------------


def test_constant_scheme() -> None:
    assert list(ConstantScheme(3, times=2).get_request_iterator()) == [3, 3]
    assert list(ConstantScheme(3, num_examples=7).get_request_iterator()) == [3, 3, 1]
    assert list(ConstantScheme(3, num_examples=6).get_request_iterator()) == [3, 3]
    assert list(itertools.islice(ConstantScheme(3).get_request_iterator(), 5)) == [3] * 5
    assert ConstantScheme(3, times=2).num_requests() == 2
    assert ConstantScheme(3, num_examples=7).num_requests() == 3
    assert ConstantScheme(3).num_requests() is None
    with pytest.raises(ConfigError, match="num_examples=7 and times=2"):
        ConstantScheme(3, num_examples=7, times=2)
    with pytest.raises(ConfigError, match="times=-1"):
        ConstantScheme(3, times=-1)


# --- ConcatenatedScheme and cross_validation -----------------------------------------


def test_concatenated_scheme() -> None:
    scheme = ConcatenatedScheme([SequentialScheme(4, 3), SequentialScheme([7, 8], 5)])
    assert list(scheme.get_request_iterator()) == [[0, 1, 2], [3], [7, 8]]
    assert scheme.num_requests() == 3
    assert scheme.requests_examples is False
    assert scheme.seed is None
    with pytest.raises(SchemeError, match="same type of requests"):
        ConcatenatedScheme([SequentialScheme(4, 2), SequentialExampleScheme(4)])
    assert ConcatenatedScheme([SequentialScheme(4, 2), ConstantScheme(1)]).num_requests() is None


def test_concatenated_scheme_is_deterministic_per_epoch() -> None:
    def build() -> ConcatenatedScheme:
        return ConcatenatedScheme(
            [ShuffledExampleScheme(5, rng=1), ShuffledExampleScheme(5, rng=2)]
        )

    a, b = build(), build()
    list(a.get_request_iterator())
    list(a.get_request_iterator())
    assert list(a.get_request_iterator(epoch=4)) == list(b.get_request_iterator(epoch=4))
    assert list(a.get_request_iterator()) == list(b.get_request_iterator(epoch=2))
    assert a.seed == b.seed is not None
    assert a.seed != ConcatenatedScheme([ShuffledExampleScheme(5, rng=9)]).seed


class FuelStyleScheme(IterationScheme):
    """A Fuel-era subclass: overrides get_request_iterator without ``epoch``."""

    requests_examples = True

    def get_request_iterator(self) -> Iterator[int]:  # type: ignore[override]
        return iter([0, 1])


def test_fuel_style_subclass_in_a_concatenation() -> None:
    scheme = ConcatenatedScheme([FuelStyleScheme(), SequentialExampleScheme([5])])
    assert list(scheme.get_request_iterator(epoch=3)) == [0, 1, 5]
    assert scheme.num_requests() is None


def test_cross_validation_folds() -> None:
    folds = list(cross_validation(SequentialExampleScheme, 10, 5))
    assert len(folds) == 5
    for i, (train, valid) in enumerate(folds):
        assert list(valid.get_request_iterator()) == [2 * i, 2 * i + 1]
        assert sorted(train.get_request_iterator()) == sorted(set(range(10)) - {2 * i, 2 * i + 1})
    train, valid = cross_validation(SequentialScheme, 10, 5, which_fold=4, batch_size=3)
    assert list(valid.get_request_iterator()) == [[8, 9]]
    assert list(train.get_request_iterator()) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_cross_validation_non_strict_and_errors() -> None:
    folds = list(cross_validation(SequentialExampleScheme, 7, 3, strict=False))
    assert [size for _, _, size in folds] == [2, 2, 3]
    counts = Counter(i for _, valid, _ in folds for i in valid.get_request_iterator())
    assert sorted(counts) == list(range(7)) and set(counts.values()) == {1}
    lazy = cross_validation(SequentialExampleScheme, 7, 3)  # a generator, as Fuel's
    with pytest.raises(ConfigError, match="7 examples are not divisible into 3"):
        next(lazy)
    with pytest.raises(ConfigError, match="which_fold=3"):
        cross_validation(SequentialExampleScheme, 6, 3, which_fold=3)
    with pytest.raises(ConfigError, match="num_folds=0"):
        next(cross_validation(SequentialExampleScheme, 6, 0))
