"""The arithmetic of stripes (batchq/protocol/stripes.py) and where stripes are placed."""

from __future__ import annotations

import itertools

import pytest

from batchq.client.cluster import SLOTS, key_slot
from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys, is_stripe, queue_from_meta_key, stripe_name
from batchq.protocol.layout import ledger_field, parse_ledger_field
from batchq.protocol.ranks import RankLayout
from batchq.protocol.stripes import Stripes, check_stripes


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_shard_belongs_to_one_stripe_once(count: int) -> None:
    stripes = Stripes(count)
    seen = {stripes.of(n) for n in range(200)}
    assert len(seen) == 200
    assert all(stripes.local(*stripes.of(n)) == n for n in range(200))
    for k in range(count):  # a stripe's shards, in order, are its m = 0, 1, 2...
        assert [m for n in range(200) for s, m in [stripes.of(n)] if s == k] == list(
            range(len([n for n in range(200) if n % count == k]))
        )


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_a_stripe_floor_counts_its_shards_below_the_trainers(count: int) -> None:
    stripes = Stripes(count)
    for floor, k in itertools.product(range(40), range(count)):
        below = [n for n in range(floor) if n % count == k]
        assert stripes.floor_of(floor, k) == len(below)
        # A published stripe floor is stale exactly when the trainer's moved past below().
        published = stripes.floor_of(floor, k)
        assert (floor > stripes.below(published, k)) == (stripes.floor_of(floor, k) > published)
        assert stripes.floor_of(stripes.below(published, k) + 1, k) > published


@pytest.mark.parametrize(
    ("shards", "world", "even"), [(10, 1, "pad"), (22, 4, "pad"), (9, 2, "drop")]
)
def test_a_stripes_lease_names_the_plans_slot(shards: int, world: int, even: str) -> None:
    layout = RankLayout(shards, world, even)
    stripes = Stripes(3)
    for rank, n in itertools.product(range(world), range(3 * layout.per_rank)):
        k, m = stripes.of(n)
        g_stripe = layout.to_global(m, rank)  # what lease.lua of stripe k grants
        assert stripes.plan_g(g_stripe, k, RankLayout(layout.slots, world)) == layout.to_global(
            n, rank
        )


def test_ledger_pairs_and_requeues_go_to_their_stripe_in_its_numbers() -> None:
    stripes = Stripes(3)
    pairs = [(ledger_field(1, j), "d") for j in range(10)]  # epoch 1 of 10 shards
    split = stripes.split(pairs, 10)
    assert sorted(v for k in split for v in split[k]) == sorted(
        (ledger_field(*divmod(m, 10)), "d") for n in range(10, 20) for _, m in [stripes.of(n)]
    )
    assert split[1] == [(ledger_field(0, m), "d") for m in (3, 4, 5, 6)]  # n = 10, 13, 16, 19
    assert stripes.shards_of([10, 11, 12, 13], 1) == [3, 4]  # n 10, 13: stripe 1's m 3, 4


@pytest.mark.parametrize(("shards", "world", "count"), [(22, 3, 2), (22, 2, 3), (9, 4, 2)])
def test_an_elastic_remap_goes_to_each_stripe_in_its_numbers(
    shards: int, world: int, count: int
) -> None:
    layout, stripes = RankLayout(shards, world), Stripes(count)
    plain = RankLayout(layout.slots, world)  # what a lease's slots make (Lease.address)
    for g in range(4 * layout.slots):  # stripe_g is plan_g's inverse
        k, g_stripe = stripes.stripe_g(g, layout)
        assert stripes.plan_g(g_stripe, k, plain) == g
    for epoch in range(5):
        slots = {s: (s * 7) % shards for s in range(layout.slots - 2)}  # slot -> shard
        pairs = [
            (ledger_field(epoch, s), "d" if s not in slots else "2") for s in range(layout.slots)
        ]
        split = stripes.split_remap(pairs, (epoch, slots), layout)
        assert sum(len(p) for p, _ in split.values()) == len(pairs)
        for k, (got_pairs, (stripe_epoch, stripe_slots)) in split.items():
            assert stripe_epoch == epoch // count  # the whole epoch lies in this one
            for s, shard in stripe_slots.items():  # lease.lua's view: the plan's shard
                g = stripes.plan_g(stripe_epoch * layout.slots + s, k, plain)
                assert g // layout.slots == epoch
                assert slots[g % layout.slots] == shard
            assert len(stripe_slots) == sum(
                1 for s in slots if stripes.stripe_g(epoch * layout.slots + s, layout)[0] == k
            )
            for field, value in got_pairs:
                e, s = parse_ledger_field(field)
                g = stripes.plan_g(e * layout.slots + s, k, plain)
                assert (ledger_field(*divmod(g, layout.slots)), value) in pairs


def test_a_bad_stripe_count_is_refused() -> None:
    for bad in (0, -1, 65, 1.5, "3", True):
        with pytest.raises(ConfigError, match="stripes"):
            check_stripes(bad)


@pytest.mark.parametrize("count", [2, 3])
def test_stripes_land_on_as_many_equal_slot_ranges_as_they_are(count: int) -> None:
    # On a cluster of ``count`` masters with equal ranges of slots: one stripe each.
    for i in range(300):
        queue = f"q{i}"
        ranges = {key_slot(QueueKeys(queue).stripe(k, count).meta) * count // SLOTS
                  for k in range(count)}  # fmt: skip
        assert len(ranges) == count, queue


def test_stripe_names_are_pure_reserved_and_hidden_from_discovery() -> None:
    name = stripe_name("tutorial", 2, 3)
    assert name == stripe_name("tutorial", 2, 3) and name.startswith("tutorial--s2.")
    assert is_stripe(name) and not is_stripe("tutorial")
    assert stripe_name("tutorial", 0, 3) == "tutorial"
    assert queue_from_meta_key(QueueKeys(name).meta) is None
    assert queue_from_meta_key(QueueKeys("tutorial").meta) == "tutorial"
    with pytest.raises(ConfigError, match="too long to be striped"):
        stripe_name("x" * 125, 1, 2)
