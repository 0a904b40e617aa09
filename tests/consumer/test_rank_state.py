"""consumer.rank_state: picking, checking and re-splitting ranks' states."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from batchq.errors import ConfigError, StepMismatch
from batchq.protocol.ranks import RankLayout
from consumer.checkpoint import check_rank_state, remap_pairs, resume_run_id
from consumer.plan import past_remap
from consumer.rank_state import elastic_state, pick_rank_state, rank_position


def state(
    rank: int, world: int, consumed: dict[str, int], done: list[int], **kw: Any
) -> dict[str, Any]:
    out = {
        "version": 1, "queue": "q", "run": "r1", "fingerprint": "f", "shards": 6,
        "plan_shards": 22, "epoch": 0, "consumed": consumed, "done": done, "rank": rank,
        "world_size": world, "even_batches": "pad", "step": 3,
    }  # fmt: skip
    out.update(kw)
    return out


def test_the_same_world_takes_its_own_state() -> None:
    states = [state(r, 2, {}, []) for r in range(2)]
    assert pick_rank_state(states, 1, 2) is states[1]
    assert pick_rank_state(states[0], 0, 2) is states[0]


def test_states_of_different_steps_are_refused_naming_them() -> None:
    states = [state(0, 2, {}, [], step=3), state(1, 2, {}, [], step=4)]
    with pytest.raises(StepMismatch, match="rank 0: step 3, rank 1: step 4"):
        pick_rank_state(states, 0, 2)


def test_a_state_of_another_rank_is_refused() -> None:
    with pytest.raises(ConfigError, match="state of rank 1 of world_size 2 given to rank 0"):
        check_rank_state(state(1, 2, {}, []), 0, 2)


def test_elastic_four_to_two_re_splits_the_rest() -> None:
    # 22 one-batch shards, 4 ranks, each yielded its first 3 slots: shards 0..11 done.
    done = {"0": 1, "1": 1, "2": 1}
    states = [state(r, 4, done, [0, 1, 2]) for r in range(4)]
    new = [elastic_state(states, r, 2) for r in range(2)]
    assert [s["remap"] for s in new] == [new[0]["remap"]] * 2  # every rank computes it
    assert [shard for shard, _ in new[0]["remap"]] == list(range(12, 22))
    layout = RankLayout(22, 2, "pad")
    assert new[0]["shards"] == layout.per_rank == 11
    assert new[0]["done"] == list(range(5, 11))  # 5 units each, the rest empty
    pairs, slots = remap_pairs(new[0], layout)
    assert slots == {i: 12 + i for i in range(10)}
    assert pairs == [(f"0:{s}", "d") for s in range(10, 22)]
    assert (
        resume_run_id(new[0], 2, None)
        == resume_run_id(new[1], 2, None)
        != resume_run_id(new[0], 4, None)
    )


def test_elastic_two_to_three_pads_with_the_first_units_and_keeps_partial_shards() -> None:
    # Shards of several batches: rank 0 is 2 batches into its local shard 1 (shard 2).
    states = [state(0, 2, {"0": 3, "1": 2}, [0]), state(1, 2, {"0": 3}, [0])]
    new = elastic_state(states, 0, 3)
    units = new["remap"]
    assert units[0] == [2, 2]  # shard 2, 2 batches had
    assert Counter(s for s, _ in units[:20]) == Counter(range(2, 22))
    assert len(units) == 21 and units[20] == units[0]  # one pad: the first unit again
    assert new["consumed"] == {"0": 2}


def test_elastic_to_a_single_trainer_is_refused() -> None:
    states = [state(r, 2, {}, []) for r in range(2)]
    with pytest.raises(ConfigError, match="world_size >= 2"):
        pick_rank_state(states, 0, 1)


def test_a_state_for_every_rank_is_taken_by_any_rank_of_its_world() -> None:
    saved = state(0, 2, {}, [0, 1], every_rank=True)
    assert pick_rank_state(saved, 1, 2) == saved | {"rank": 1}
    check_rank_state(pick_rank_state(saved, 1, 2), 1, 2)  # its own now


def test_a_state_for_every_rank_re_splits_for_another_world() -> None:
    saved = state(0, 2, {}, [0, 1], every_rank=True)
    every = [state(r, 2, {}, [0, 1], every_rank=True) for r in range(2)]
    for rank in range(3):
        assert pick_rank_state(saved, rank, 3) == elastic_state(every, rank, 3)


def test_a_state_of_one_rank_alone_says_when_it_stands_for_all() -> None:
    with pytest.raises(ConfigError, match="with ordered=True, outside an epoch re-split"):
        check_rank_state(pick_rank_state(state(0, 2, {}, []), 1, 2), 1, 2)
    with pytest.raises(ConfigError, match="world_size"):
        pick_rank_state(state(0, 1, {}, [], every_rank=True), 0, 2)


def test_elastic_again_from_states_inside_a_re_split_epoch() -> None:
    # 6 shards of 4 batches, 2 ranks: shard 0 done, shard 1 one batch in.
    first = [state(0, 2, {"0": 4}, [0], shards=3, plan_shards=6, step=5),
             state(1, 2, {"0": 1}, [], shards=3, plan_shards=6, step=5)]  # fmt: skip
    resplit = [elastic_state(first, r, 3) for r in range(3)]
    remap = [[1, 1], [2, 0], [3, 0], [4, 0], [5, 0], [1, 1]]  # slot 5: a pad (shard 1 again)
    assert resplit[0]["remap"] == remap and resplit[0]["resplit"] is True
    # Four batches later each of the 3 ranks (slot u: rank u % 3, local u // 3): rank 0
    # finished shard 1 (from its base, 1) and is 1 batch into shard 4; rank 1 finished
    # shard 2; rank 2 finished shard 3 and is 1 batch into the pad (shard 1, base 1).
    inside = [
        state(0, 3, {"0": 4, "1": 1}, [0], shards=2, plan_shards=6, step=9, remap=remap),
        state(1, 3, {"0": 4}, [0], shards=2, plan_shards=6, step=9, remap=remap),
        state(2, 3, {"0": 4, "1": 2}, [0], shards=2, plan_shards=6, step=9, remap=remap),
    ]  # fmt: skip
    assert pick_rank_state(inside, 2, 3) is inside[2]  # the same world: its own, remap kept
    again = [pick_rank_state(inside, r, 2) for r in range(2)]
    # The units: shard 4 from its rank's count (base 0 + 1), shard 5 untouched; the pad goes.
    assert again[0]["remap"] == again[1]["remap"] == [[4, 1], [5, 0]]
    assert again[0]["consumed"] == {"0": 1} and again[1]["consumed"] == {}
    assert again[0]["done"] == [1, 2] and again[0]["step"] == 9
    pairs, slots = remap_pairs(again[0], RankLayout(6, 2, "pad"))
    assert slots == {0: 4, 1: 5}
    assert pairs == [("0:0", "1"), *((f"0:{s}", "d") for s in range(2, 6))]


def test_states_of_one_checkpoint_must_agree_on_the_remap() -> None:
    states = [state(0, 2, {}, [], remap=[[3, 0], [4, 0]]), state(1, 2, {}, [])]
    with pytest.raises(ConfigError, match="disagree on 'remap'"):
        elastic_state(states, 0, 3)


def test_the_slots_past_a_remap_are_kept_for_a_lost_queue() -> None:
    states = [state(r, 4, {"0": 1, "1": 1, "2": 1}, [0, 1, 2]) for r in range(4)]
    resplit = elastic_state(states, 0, 2)
    pairs, slots = remap_pairs(resplit, RankLayout(22, 2, "pad"))
    later = [("0:0", "d"), ("0:3", "2"), ("1:12", "d")]  # own slots, another epoch's
    assert past_remap([*pairs, *later], (0, slots)) == [(f"0:{s}", "d") for s in range(10, 22)]
    assert past_remap(pairs, None) == []


def short_last(
    rank: int, even: str, plan_shards: int, epoch_batches: int, k: int
) -> dict[str, Any]:
    """Rank ``rank``'s every_rank state, k batches into epoch 0 of a plan of shards of 5
    batches whose last is short."""
    return state(
        rank, 2, {}, [], every_rank=True, plan_shards=plan_shards, even_batches=even,
        shards=-(-plan_shards // 2), yielding=[0, k], shard_batches=5,
        epoch_batches=epoch_batches, step=k,
    )  # fmt: skip


def test_where_the_last_shard_is_short_each_rank_s_position_is_rebuilt() -> None:
    # 5 shards of 5, the last of 2: rank 0 builds shards 0, 2, 4 (12 batches), rank 1
    # shards 1, 3 and a pad of shard 0 (15); 'pad' evens both to 15.
    saved = short_last(0, "pad", 5, 22, 7)
    saved |= {"consumed": {"0": 5, "1": 2}, "done": [0]}
    assert pick_rank_state(saved, 0, 2) is not saved and pick_rank_state(saved, 0, 2) == saved
    one = pick_rank_state(saved, 1, 2)
    assert (one["rank"], one["epoch"], one["consumed"], one["done"]) == (
        1, 0, {"0": 5, "1": 2}, [0]
    )  # fmt: skip
    check_rank_state(one, 1, 2)
    whole = pick_rank_state(short_last(0, "pad", 5, 22, 15) | {"epoch": 1}, 1, 2)
    assert (whole["epoch"], whole["consumed"], whole["done"]) == (1, {}, [])


def test_a_state_taken_while_a_rank_yields_its_pads_is_refused_for_as_many_ranks() -> None:
    # 13 batches in: rank 0 (12 of its own) yields its run-time pads, rank 1 is 3 batches
    # into its pad slot. Resumed, rank 0's pads are not replayed: its epoch would end 2
    # batches before rank 1's, which ranks that step together cannot follow.
    for saver in (0, 1):
        padding = short_last(saver, "pad", 5, 22, 13)
        for rank in (0, 1):
            with pytest.raises(ConfigError, match=r"rank\(s\) \[0\] yielded their run-time pads"):
                pick_rank_state(padding, rank, 2)
    # Re-split for another world it resumes: rank 0 in the epoch with its shards done,
    # rank 1's shards 1 and 3 done too: nothing of epoch 0 is left to re-split.
    resumed = pick_rank_state(short_last(0, "pad", 5, 22, 13) | {"epoch": 1}, 0, 3)
    assert (resumed["resplit"], resumed["remap"]) == (True, [])


def test_under_drop_a_rank_past_the_fewest_batches_is_in_the_next_epoch() -> None:
    # 4 shards of 5, the last of 2: rank 0 holds 10, rank 1 7; 'drop' cuts both at 7.
    zero = pick_rank_state(short_last(1, "drop", 4, 17, 6), 0, 2)
    assert (zero["epoch"], zero["consumed"], zero["done"]) == (0, {"0": 5, "1": 1}, [0])
    cut = pick_rank_state(short_last(1, "drop", 4, 17, 7), 0, 2)
    assert (cut["epoch"], cut["consumed"], cut["done"]) == (1, {}, [])


def test_a_short_last_shard_state_re_splits_from_every_rank_s_rebuilt_position() -> None:
    saved = short_last(0, "pad", 5, 22, 13) | {"epoch": 1}  # rank 0 in its pads
    every = [rank_position(saved, r, re_split=True) for r in range(2)]
    assert [s["epoch"] for s in every] == [0, 0]  # one epoch: the re-split's
    assert every[0]["done"] == [0, 1, 2] and every[1]["consumed"] == {"0": 5, "1": 5, "2": 3}
    for rank in range(3):
        assert pick_rank_state(saved, rank, 3) == elastic_state(every, rank, 3)
    middle = short_last(0, "pad", 5, 22, 7) | {"consumed": {"0": 5, "1": 2}, "done": [0]}
    units = pick_rank_state(middle, 0, 3)["remap"]
    assert units[:3] == [[2, 2], [3, 2], [4, 0]]  # shards 2 and 3 from their 3rd batch


@pytest.mark.parametrize(
    "bad", [{"yielding": [0]}, {"yielding": [0, -1]}, {"shard_batches": "5"}, {"epoch_batches": 30}]
)
def test_a_short_last_shard_state_with_bad_figures_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"yielding .* are not valid"):
        pick_rank_state(short_last(0, "pad", 5, 22, 7) | bad, 1, 2)


def test_a_list_with_a_rank_past_its_share_re_splits_but_not_for_as_many_ranks() -> None:
    # Rank 1 had finished its share of epoch 0 (its pads) while rank 0 read on: its own
    # state says epoch 1, empty. Re-split, it is in epoch 0 with every shard done.
    states = [state(0, 2, {"0": 3, "1": 2}, [0]), state(1, 2, {}, [], epoch=1)]
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] had finished their share"):
        pick_rank_state(states, 0, 2)
    new = pick_rank_state(states, 0, 3)
    # Only rank 0's unfinished shards are left: shard 2 (its local 1) from batch 2, then
    # shards 4, 6, ... (its locals 2..10); rank 1's count as done.
    assert new["remap"][0] == [2, 2] and all(shard % 2 == 0 for shard, _ in new["remap"])
    with pytest.raises(ConfigError, match=r"states of epochs \[0, 2\]"):
        pick_rank_state([state(0, 2, {}, []), state(1, 2, {}, [], epoch=2)], 0, 3)


def counted(rank: int, even: str, k: int, counts: list[list[int]]) -> dict[str, Any]:
    """Rank ``rank``'s every_rank state k batches into epoch 0 of a plan that cannot count
    its shards (a Filter: 3 local shards a rank), with each rank's published counts."""
    return state(
        rank, 2, {}, [], every_rank=True, plan_shards=6, shards=3, even_batches=even,
        yielding=[0, k], shard_counts=counts, step=k,
    )  # fmt: skip


def test_where_the_plan_cannot_count_shards_the_published_counts_rebuild_each_rank() -> None:
    # Rank 0's shards hold 3, 0, 2 batches (all said), rank 1 had said its first: 1.
    counts = [[3, 0, 2], [1]]
    saved = counted(0, "pad", 4, counts) | {"consumed": {"0": 3, "2": 1}, "done": [0, 1]}
    assert pick_rank_state(saved, 0, 2) == saved  # the saving rank keeps its own
    one = pick_rank_state(saved, 1, 2)
    # Past the shard it said (1 batch), rank 1 is 3 batches into its next shard.
    assert (one["rank"], one["epoch"], one["consumed"], one["done"]) == (
        1, 0, {"0": 1, "1": 3}, [0]
    )  # fmt: skip
    check_rank_state(one, 1, 2)
    # An empty shard is done wherever it is (a re-split deals no empty unit); past a shard
    # not said, nothing said is done but empty ones.
    zero = pick_rank_state(counted(1, "pad", 3, counts), 0, 2)
    assert (zero["consumed"], zero["done"]) == ({"0": 3}, [0, 1])
    early = pick_rank_state(counted(1, "pad", 2, counts), 0, 2)
    assert (early["consumed"], early["done"]) == ({"0": 2}, [1])
    holes = counted(0, "pad", 4, [[3, 0, 2], [1, None, 2, 0]]) | {"shards": 4, "plan_shards": 8}
    one = pick_rank_state(holes, 1, 2)
    assert (one["consumed"], one["done"]) == ({"0": 1, "1": 3}, [0, 3])


def test_published_counts_say_when_an_epoch_was_handed_out_or_a_rank_pads() -> None:
    # Every share known: 'pad' evens to the most (5): at 5 both are in the next epoch.
    whole = [[3, 0, 2], [1, 1, 1]]
    done = pick_rank_state(counted(0, "pad", 5, whole), 1, 2)
    assert (done["epoch"], done["consumed"], done["done"]) == (1, {}, [])
    # At 4 rank 1 (3 batches) yields its pads: refused for as many ranks, not re-split.
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] yielded their run-time pads"):
        pick_rank_state(counted(0, "pad", 4, whole), 0, 2)
    assert pick_rank_state(counted(0, "pad", 4, whole), 0, 3)["resplit"] is True
    # 'drop': a whole share of k batches ends the epoch for every rank, known or not,
    # the saving rank's own too (its cut is made as it asks for the next batch).
    for rank in (0, 1):
        cut = pick_rank_state(counted(0, "drop", 3, [[3, 0, 2], [1, 2, 0]]), rank, 2)
        assert (cut["epoch"], cut["consumed"]) == (1, {})
    going = pick_rank_state(counted(1, "drop", 3, [[3], [1, 2, 0]]), 0, 2)
    assert (going["epoch"], going["consumed"], going["done"]) == (1, {}, [])
    inside = pick_rank_state(counted(1, "drop", 2, [[3], [1, 2, 0]]), 0, 2)
    assert (inside["epoch"], inside["consumed"], inside["done"]) == (0, {"0": 2}, [])


def test_published_counts_re_split_from_every_rank_s_rebuilt_position() -> None:
    saved = counted(0, "pad", 4, [[3, 0, 2], [1]])
    every = [rank_position(saved, r, re_split=True) for r in range(2)]
    assert [(s["consumed"], s["done"]) for s in every] == [
        ({"0": 3, "2": 1}, [0, 1]), ({"0": 1, "1": 3}, [0])
    ]  # fmt: skip
    for rank in range(3):
        assert pick_rank_state(saved, rank, 3) == elastic_state(every, rank, 3)


@pytest.mark.parametrize(
    "bad",
    [[[3], [1], [2]], [[3, 0, 2, 1], []], [[-1], []], [["3"], []], [[True], []], "x", [[1.0], []]],
)
def test_published_counts_that_are_not_valid_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"shard_counts .* are not valid"):
        pick_rank_state(counted(0, "pad", 2, bad), 1, 2)


def test_a_re_split_deals_no_shard_known_to_be_empty() -> None:
    # Rank 0's shards 0, 2, 4 hold 3, 0, 2; rank 1 said its shard 1 (1) and 5 (empty),
    # and is inside shard 3. A new rank given only empty units would have nothing to pad
    # with (a reviewer's RankLost): known empty shards are done, never units.
    saved = counted(0, "pad", 4, [[3, 0, 2], [1, None, 0]])
    remap = pick_rank_state(saved, 0, 3)["remap"]
    assert remap == [[3, 3], [4, 1], [3, 3]]  # shard 3 from its 4th batch, 4 from its 2nd


def test_a_list_of_states_standing_for_every_rank_reads_each_as_one() -> None:
    # An all-gather of a Filter's 'drop' states at the epoch's last step: rank 0 had not
    # cut its longer share yet, rank 1's share had ended (its state says the next
    # epoch). Each stands for every rank, so both resume in the next epoch (refused
    # before: one rank past the epoch while another was inside it).
    counts = [[3, 0, 2], [1, 2, 0]]
    states = [
        counted(0, "drop", 3, counts) | {"consumed": {"0": 3}, "done": [0, 1]},
        counted(1, "drop", 3, counts) | {"rank": 1, "epoch": 1},
    ]
    for rank in (0, 1):
        mine = pick_rank_state(states, rank, 2)
        assert (mine["rank"], mine["epoch"], mine["consumed"]) == (rank, 1, {})
