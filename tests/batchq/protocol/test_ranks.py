"""batchq.protocol.ranks: how a plan's slots split among ranks."""

from __future__ import annotations

import pytest

from batchq.errors import ConfigError
from batchq.protocol.ranks import RankLayout, rank_field, shard_of_slot, slots_for


@pytest.mark.parametrize(
    ("shards", "world", "even", "slots"),
    [
        (22, 1, "pad", 22),
        (22, 4, "pad", 24),
        (22, 4, "drop", 20),
        (8, 4, "pad", 8),
        (3, 4, "pad", 4),
    ],
)
def test_slots(shards: int, world: int, even: str, slots: int) -> None:
    assert slots_for(shards, world, even) == slots


def test_drop_with_fewer_shards_than_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="3 shards per epoch and world_size 4"):
        slots_for(3, 4, "drop")


def test_every_slot_has_one_rank_and_pads_are_the_first_shards() -> None:
    layout = RankLayout(22, 4, "pad")
    assert layout.per_rank == 6 and layout.pads == 2
    seen = []
    for rank in range(4):
        for j in range(layout.per_rank):
            slot = layout.slot(j, rank)
            assert layout.local(slot, rank) == j
            assert all(layout.local(slot, other) is None for other in range(4) if other != rank)
            seen.append(slot)
    assert sorted(seen) == list(range(24))
    assert [layout.shard_of(s) for s in (21, 22, 23)] == [21, 0, 1]
    assert shard_of_slot(23, 22) == 1


def test_global_numbers_count_each_rank_in_its_own_terms() -> None:
    layout = RankLayout(22, 4, "pad")
    # rank 3's 7th local shard: epoch 1, local 0 -> slot 3 of epoch 1.
    assert layout.to_global(6, 3) == 24 + 3
    assert layout.split(24 + 3) == (1, 3, 3)


def test_field_names() -> None:
    assert rank_field("next", 0, 1) == "next"
    assert rank_field("next", 2, 4) == "next:2"


@pytest.mark.parametrize(("world", "even"), [(0, "pad"), (2, "cut")])
def test_bad_layouts_are_refused(world: int, even: str) -> None:
    with pytest.raises(ConfigError):
        RankLayout(10, world, even)


def test_each_rank_s_batches_where_the_plan_counts_them() -> None:
    # 5 shards of 5, the last of 2: rank 0 builds shards 0, 2, 4; rank 1 1, 3 and a pad
    # of shard 0.
    pad = RankLayout(5, 2, "pad")
    assert pad.shard_counts(5, 22) == [5, 5, 5, 5, 2]
    assert pad.slot_batches(5, 22) == [[5, 5, 2], [5, 5, 5]]
    assert pad.epoch_count([[5, 5, 2], [5, 5, 5]]) == 15
    drop = RankLayout(4, 2, "drop")
    assert drop.slot_batches(5, 17) == [[5, 5], [5, 2]]
    assert drop.epoch_count([[5, 5], [5, 2]]) == 7
    # Not counted: B unknown (a Filter), or E not S shards of B with a last of 1 to B.
    assert pad.slot_batches(0, 22) is None
    assert pad.slot_batches(5, 20) is None and pad.slot_batches(5, 26) is None
    assert pad.slot_batches(5, 25) == [[5, 5, 5], [5, 5, 5]]
