"""Randomness: every random component has its own stream; a RandomState gives Fuel's draws.

The Fuel references below are written from Fuel's documented algorithm (its schemes
shuffle ``list(indices)`` in place with their RandomState once per epoch; its image
transformers draw with ``random_integers`` / ``uniform`` on the RandomState they were
given), not from Fuel's code or tests.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from producer.datasets import IndexableDataset
from producer.errors import ConfigError
from producer.randomness import FuelShuffles, RandomStateMixin, component_seed, state_seed
from producer.schemes import (
    SequentialExampleScheme,
    SequentialScheme,
    ShuffledExampleScheme,
    ShuffledScheme,
)
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream
from producer.transformers import Merge, SourcewiseTransformer
from producer.transformers.image import Random2DRotation, RandomFixedSizeCrop

# --- helpers ---------------------------------------------------------------------------


def fuel_orders(seed: int, indices: list[int], epochs: int) -> list[list[int]]:
    """Fuel's epochs: one in-place shuffle of a fresh list per epoch, same RandomState."""
    rng = np.random.RandomState(seed)
    orders = []
    for _ in range(epochs):
        order = list(indices)
        rng.shuffle(order)
        orders.append(order)
    return orders


def coded_images(count: int, size: int) -> np.ndarray:
    """Images whose pixel values say where they are: a crop's corner gives its offset."""
    plane = np.arange(size * size, dtype=np.int64).reshape(size, size)
    return np.broadcast_to(plane, (count, 1, size, size)).copy()


def offsets(crop: np.ndarray, size: int) -> tuple[int, int]:
    top, left = divmod(int(crop[0, 0, 0]), size)
    return top, left


class RandomFlip(RandomStateMixin, SourcewiseTransformer):
    """A user transformer written the documented way (see the README)."""

    def __init__(self, data_stream: Any, rng: Any = None, **kwargs: Any) -> None:
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        self.rng = rng

    def transform_source_example(self, source_example: Any, source_name: str) -> Any:
        if self.rng.uniform() < 0.5:
            return source_example[..., ::-1]
        return source_example


class RecordingRotation(Random2DRotation):
    """Random2DRotation that also records the angles it draws (degrees)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.angles: list[float] = []

    def _rotate(self, image: np.ndarray, degrees: float) -> np.ndarray:
        self.angles.append(float(degrees))
        return super()._rotate(image, degrees)


class RecordingCrop(RandomFixedSizeCrop):
    """RandomFixedSizeCrop that also records its top offsets (its first draw per image)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tops: list[int] = []

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        out = super()._transform_image(image)
        self.tops.append(int(np.flatnonzero(np.isin(image[0], out[0, 0]))[0] // SIZE))
        return out


SIZE = 10


def augmented_chain(count: int, rng_a: Any = None, rng_b: Any = None) -> Any:
    images = coded_images(count, SIZE)
    dataset = IndexableDataset({"a": images, "b": images.copy(), "c": images.copy()})
    stream = DataStream(dataset, iteration_scheme=SequentialExampleScheme(count))
    stream = RandomFixedSizeCrop(stream, (4, 4), which_sources=("a",), rng=rng_a)
    stream = RandomFixedSizeCrop(stream, (4, 4), which_sources=("b",), rng=rng_b)
    return RandomFlip(stream, which_sources=("c",))


def served(stream: Any, epochs: int, requests_per_shard: int = 10) -> list[tuple[Any, ...]]:
    plan = ShardPlan(stream, requests_per_shard)
    return [
        item
        for epoch in range(epochs)
        for shard in range(plan.shards)
        for item in plan.iter_shard(epoch, shard)
    ]


def draws(items: list[tuple[Any, ...]]) -> dict[str, np.ndarray]:
    a = np.array([offsets(item[0], SIZE) for item in items], dtype=float)
    b = np.array([offsets(item[1], SIZE) for item in items], dtype=float)
    flipped = np.array([float(item[2][0, 0, 0] != 0) for item in items])
    return {"a_top": a[:, 0], "a_left": a[:, 1], "b_top": b[:, 0], "flip": flipped}


def assert_uncorrelated(x: np.ndarray, y: np.ndarray) -> None:
    # 1,200 samples: |r| of independent streams is about 0.03; 0.15 is five sigmas.
    assert np.std(x) > 0 and np.std(y) > 0
    r = float(np.corrcoef(x, y)[0, 1])
    assert abs(r) < 0.15, r


# --- independence ----------------------------------------------------------------------


def test_default_rng_transformers_are_uncorrelated_when_served() -> None:
    values = draws(served(augmented_chain(200), epochs=6))
    assert len(values["a_top"]) == 1200
    assert not np.array_equal(values["a_top"], values["b_top"])
    assert_uncorrelated(values["a_top"], values["b_top"])
    assert_uncorrelated(values["a_left"], values["b_top"])
    assert_uncorrelated(values["a_top"], values["flip"])  # the user's own transformer
    assert 0.4 < values["flip"].mean() < 0.6


def test_same_int_seed_on_two_transformers_still_differs_when_served() -> None:
    values = draws(served(augmented_chain(200, rng_a=5, rng_b=5), epochs=6))
    assert_uncorrelated(values["a_top"], values["b_top"])


def test_default_rng_transformers_are_uncorrelated_in_process() -> None:
    stream = augmented_chain(200)
    items = [item for _ in range(6) for item in stream.get_epoch_iterator()]
    values = draws(items)
    assert_uncorrelated(values["a_top"], values["b_top"])
    assert_uncorrelated(values["a_top"], values["flip"])


def test_rotation_and_crop_at_default_rngs_are_uncorrelated() -> None:
    # The case: the crop offset was a function of the rotation angle.
    images = coded_images(200, SIZE).astype(np.float64)
    stream = DataStream(IndexableDataset({"x": images}), SequentialExampleScheme(200))
    rotation = RecordingRotation(stream, which_sources=("x",))
    crop = RecordingCrop(rotation, (SIZE - 4, SIZE - 4), which_sources=("x",))
    for item in served(crop, epochs=6):
        assert item[0].shape == (1, SIZE - 4, SIZE - 4)
    assert len(rotation.angles) == len(crop.tops) == 1200
    assert_uncorrelated(np.array(rotation.angles), np.array(crop.tops, dtype=float))


def test_redone_shard_is_identical_with_default_rngs() -> None:
    stream = augmented_chain(60)
    plan = ShardPlan(stream, 10)
    first = [tuple(x.copy() for x in item) for item in plan.iter_shard(2, 3)]
    list(plan.iter_shard(0, 1))
    list(plan.iter_shard(5, 0))
    again = list(plan.iter_shard(2, 3))
    assert len(first) == len(again) == 10
    for x, y in zip(first, again, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)
    # Another producer building the same pipeline builds the same shard.
    other = list(ShardPlan(augmented_chain(60), 10).iter_shard(2, 3))
    for x, y in zip(first, other, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)


def test_component_seeds_differ_by_position_and_shard() -> None:
    seeds = {component_seed(s, p) for s in range(20) for p in range(5)}
    assert len(seeds) == 100
    assert component_seed(3, 1) == component_seed(3, 1)


def test_reseed_keeps_the_kind_of_generator() -> None:
    stream = DataStream(
        IndexableDataset({"x": coded_images(4, SIZE)}), iteration_scheme=SequentialScheme(4, 2)
    )
    fuel = RandomFixedSizeCrop(stream, (4, 4), rng=np.random.RandomState(3))
    ours = RandomFixedSizeCrop(stream, (4, 4), rng=3)
    assert fuel.fuel_rng and not ours.fuel_rng
    fuel.reseed(7)
    ours.reseed(7)
    assert isinstance(fuel.rng, np.random.RandomState)
    assert isinstance(ours.rng, np.random.Generator)
    with pytest.raises(ConfigError, match="reseed"):
        ours.reseed(-2)


# --- Fuel's orders for Fuel's seeds ----------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_shuffled_scheme_with_random_state_gives_fuels_permutations(seed: int) -> None:
    n, batch_size, epochs = 23, 5, 6
    expected = fuel_orders(seed, list(range(n)), epochs)
    scheme = ShuffledScheme(n, batch_size, rng=np.random.RandomState(seed))
    for epoch in range(epochs):  # the Fuel way: one call per epoch, no argument
        batches = list(scheme.get_request_iterator())
        order = expected[epoch]
        assert batches == [order[i : i + batch_size] for i in range(0, n, batch_size)]
    # Any epoch directly, on a fresh scheme and out of order (the producers' way).
    fresh = ShuffledScheme(n, batch_size, rng=np.random.RandomState(seed))
    for epoch in (4, 1, 5, 0):
        flat = [i for batch in fresh.get_request_iterator(epoch=epoch) for i in batch]
        assert flat == expected[epoch]


def test_shuffled_example_scheme_with_random_state_gives_fuels_permutations() -> None:
    indices = [3, 30, 7, 70, 11, 110, 5]
    expected = fuel_orders(42, indices, 4)
    scheme = ShuffledExampleScheme(indices, rng=np.random.RandomState(42))
    assert [list(scheme.get_request_iterator()) for _ in range(4)] == expected
    assert list(scheme.get_request_iterator(epoch=3)) == expected[3]


def test_sorted_indices_sorts_fuels_batches() -> None:
    expected = fuel_orders(9, list(range(12)), 2)[1]
    scheme = ShuffledScheme(12, 4, rng=np.random.RandomState(9), sorted_indices=True)
    assert list(scheme.get_request_iterator(epoch=1)) == [
        sorted(expected[i : i + 4]) for i in range(0, 12, 4)
    ]


def test_served_plan_follows_fuels_permutations() -> None:
    n = 17
    stream = DataStream(
        IndexableDataset({"x": np.arange(n)}),
        iteration_scheme=ShuffledExampleScheme(n, rng=np.random.RandomState(5)),
    )
    plan = ShardPlan(stream, 4)
    expected = fuel_orders(5, list(range(n)), 3)
    for epoch in (2, 0, 1):
        got = [int(x) for shard in range(plan.shards) for (x,) in plan.iter_shard(epoch, shard)]
        assert got == expected[epoch]


def test_fuel_shuffles_any_epoch_in_any_order_over_many_epochs() -> None:
    expected = fuel_orders(5, list(range(7)), 70)
    replay = FuelShuffles(np.random.RandomState(5), 7)
    for epoch in [69, 3, 17, 16, 15, 33, 0, 47, 68, 1, 40, 41, 39, 64]:
        assert replay.order(epoch).tolist() == expected[epoch]


def test_fuel_shuffles_replay_matches_sequential_draws() -> None:
    rng = np.random.RandomState(77)
    replay = FuelShuffles(rng, 9)
    expected = fuel_orders(77, list(range(9)), 8)
    assert [replay.order(e).tolist() for e in (7, 2, 0, 5)] == [expected[e] for e in (7, 2, 0, 5)]
    # The caller's RandomState moved on by one epoch's shuffle, as Fuel's first epoch does.
    reference = np.random.RandomState(77)
    reference.shuffle(list(range(9)))
    assert state_seed(rng) == state_seed(reference)


def test_integer_seeds_and_generators_keep_batchqs_scheme() -> None:
    scheme = ShuffledScheme(10, 10, rng=4)
    assert next(iter(scheme.get_request_iterator(epoch=2))) == (
        np.random.default_rng([4, 2]).permutation(10).tolist()
    )
    drawn = int(np.random.default_rng(8).integers(0, 2**32))
    from_generator = ShuffledExampleScheme(6, rng=np.random.default_rng(8))
    assert from_generator.seed == drawn
    assert list(from_generator.get_request_iterator(epoch=0)) == (
        np.random.default_rng([drawn, 0]).permutation(6).tolist()
    )


def test_random_integers_matches_random_state_random_integers() -> None:
    class Drawer(RandomStateMixin):
        pass

    drawer = Drawer()
    drawer.rng = np.random.RandomState(11)
    reference = np.random.RandomState(11)
    with pytest.warns(DeprecationWarning):
        expected = reference.random_integers(0, 6, size=50)
    assert drawer.random_integers(0, 6, size=50).tolist() == expected.tolist()


def test_crop_with_random_state_draws_fuels_offsets() -> None:
    images = coded_images(6, SIZE)
    examples = DataStream(IndexableDataset({"x": images}), SequentialExampleScheme(6))
    crop = RandomFixedSizeCrop(examples, (4, 7), rng=np.random.RandomState(2))
    got = [offsets(x, SIZE) for (x,) in crop.get_epoch_iterator()]
    reference = np.random.RandomState(2)
    expected = []
    for _ in range(6):  # per image: top then left, each only if there is room
        top = int(reference.randint(0, SIZE - 4 + 1))
        left = int(reference.randint(0, SIZE - 7 + 1))
        expected.append((top, left))
    assert got == expected
    batches = DataStream(IndexableDataset({"x": images}), SequentialScheme(6, 3))
    crop = RandomFixedSizeCrop(batches, (4, 10), rng=np.random.RandomState(2))
    got = [offsets(x[i], SIZE) for (x,) in crop.get_epoch_iterator() for i in range(3)]
    reference = np.random.RandomState(2)
    expected = []
    for _ in range(2):  # per 4-d batch: all the left offsets, then all the top offsets
        lefts = reference.randint(0, 1, size=3)
        tops = reference.randint(0, SIZE - 4 + 1, size=3)
        expected.extend(zip(tops.tolist(), lefts.tolist(), strict=True))
    assert got == expected


def test_rotation_with_random_state_draws_fuels_angles() -> None:
    images = np.zeros((4, 1, 5, 5), dtype=np.uint8)
    maximum = math.pi / 3
    examples = DataStream(IndexableDataset({"x": images}), SequentialExampleScheme(4))
    rotation = RecordingRotation(examples, maximum, rng=np.random.RandomState(6))
    list(rotation.get_epoch_iterator())
    degrees = math.degrees(maximum)
    assert rotation.maximum_rotation == pytest.approx(degrees)
    reference = np.random.RandomState(6)
    assert rotation.angles == [reference.uniform(-degrees, degrees) for _ in range(4)]
    batches = DataStream(IndexableDataset({"x": images}), SequentialScheme(4, 2))
    rotation = RecordingRotation(batches, maximum, rng=np.random.RandomState(6))
    list(rotation.get_epoch_iterator())
    reference = np.random.RandomState(6)
    expected = [a for _ in range(2) for a in reference.uniform(-degrees, degrees, 2).tolist()]
    assert rotation.angles == expected


def test_random_state_shared_by_scheme_and_transformer_is_fuels_first_epoch() -> None:
    # A Fuel script often passes one RandomState to its scheme and its transformers.
    n = 8
    rng = np.random.RandomState(31)
    scheme = ShuffledExampleScheme(n, rng=rng)
    stream = DataStream(IndexableDataset({"x": np.arange(n)}), iteration_scheme=scheme)
    flip = RandomFlip(stream, rng=rng, which_sources=())
    got = [int(x) for (x,) in flip.get_epoch_iterator()]
    reference = np.random.RandomState(31)
    order = list(range(n))
    reference.shuffle(order)
    assert got == order
    # The transformer's next draw is the one Fuel's makes after that shuffle.
    assert flip.rng.uniform() == reference.uniform()


def test_default_rng_transformers_in_two_merge_branches_differ_in_process() -> None:
    def branch() -> Any:
        images = coded_images(200, SIZE)
        stream = DataStream(IndexableDataset({"x": images}), SequentialExampleScheme(200))
        return RandomFixedSizeCrop(stream, (4, 4))

    merged = Merge([branch(), branch()], ("a", "b"))
    items = list(merged.get_epoch_iterator())
    tops = np.array([[offsets(a, SIZE)[0], offsets(b, SIZE)[0]] for a, b in items], float)
    assert_uncorrelated(tops[:, 0], tops[:, 1])
