"""consumer.checkpoint: a checkpoint's keys are a file format, pinned here."""

from __future__ import annotations

import re
from typing import Any

import pytest
from data_parallel import two_ranks_in_epoch_2

from batchq.errors import ConfigError
from batchq.protocol.layout import resume_run_id
from consumer import ServerDataStream, checkpoint
from consumer.checkpoint import check_state, stream_state
from consumer.plan import Plan
from consumer.rank_state import elastic_state

# Checkpoints saved by earlier versions must keep loading: these names never change.
SAVED_NAMES = {
    "VERSION_KEY": "version", "QUEUE_KEY": "queue", "RUN_KEY": "run",
    "FINGERPRINT_KEY": "fingerprint", "SHARDS_KEY": "shards", "EPOCH_KEY": "epoch",
    "CONSUMED_KEY": "consumed", "DONE_KEY": "done", "RANK_KEY": "rank",
    "WORLD_SIZE_KEY": "world_size", "EVEN_BATCHES_KEY": "even_batches",
    "PLAN_SHARDS_KEY": "plan_shards", "STEP_KEY": "step", "REMAP_KEY": "remap",
    "GROUP_KEY": "group",
    "PARAMS_KEY": "params", "EVERY_RANK_KEY": "every_rank", "RESPLIT_KEY": "resplit",
    "YIELDING_KEY": "yielding", "SHARD_BATCHES_KEY": "shard_batches",
    "EPOCH_BATCHES_KEY": "epoch_batches", "SHARD_COUNTS_KEY": "shard_counts",
}  # fmt: skip
KNOWN = set(SAVED_NAMES.values())


def test_the_key_names_are_those_checkpoints_were_saved_with() -> None:
    assert {n: getattr(checkpoint, n) for n in SAVED_NAMES} == SAVED_NAMES
    assert checkpoint.STATE_VERSION == 1
    builders = [
        "position_digest", "position_state", "rank_fields", "stream_state", "unstarted_state",
    ]  # fmt: skip
    checks = ["check_group_state", "check_rank_state", "check_state", "load_state"]
    loading = ["Resumed", "remap_pairs", "resume_position", "resume_run_id", "resumed_batches"]
    assert sorted(checkpoint.__all__) == sorted(
        [*SAVED_NAMES, "STATE_VERSION", *builders, *checks, *loading]
    )


def test_every_state_written_uses_only_those_keys() -> None:
    fresh = ServerDataStream(("x",), url="redis://127.0.0.1:1/0", queue="q").state_dict()
    assert set(fresh) <= KNOWN
    old = [
        {"version": 1, "queue": "q", "run": "r", "fingerprint": "f", "shards": 3,
         "plan_shards": 6, "epoch": 0, "consumed": {}, "done": [], "rank": r,
         "world_size": 2, "even_batches": "pad", "step": 0}
        for r in range(2)
    ]  # fmt: skip
    assert set(elastic_state(old, 0, 3)) <= KNOWN


def test_another_version_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="state version 2 is not valid: expected 1"):
        check_state({"version": 2, "run": "r"}, "q")


def test_the_builders_write_the_documented_state() -> None:
    assert checkpoint.unstarted_state("q") == {
        "version": 1, "queue": "q", "run": "", "fingerprint": ""
    }  # fmt: skip
    state = checkpoint.position_state("q", "r1", "fp", 4, 2, {0: 3, 2: 1}, [1])
    assert state == {
        "version": 1, "queue": "q", "run": "r1", "fingerprint": "fp", "shards": 4,
        "epoch": 2, "consumed": {"0": 3, "2": 1}, "done": [1],
    }  # fmt: skip
    assert check_state(state, "q") == state  # what is written loads
    ranks = checkpoint.rank_fields(1, 2, "pad", 8, 40)
    assert ranks == {"rank": 1, "world_size": 2, "even_batches": "pad", "plan_shards": 8,
                     "step": 40}  # fmt: skip


def test_the_run_a_checkpoint_resumes_into_is_computed_alike_by_ranks_and_groups() -> None:
    state = {"version": 1, "queue": "q", "run": "r1", "fingerprint": "f"}
    assert checkpoint.resume_run_id(state, 1, None) == ""  # a single trainer: minted anew
    ranks = checkpoint.resume_run_id(state, 2, None)
    # The groups of a sweep resume into one run, whatever their world: as the ranks do.
    assert (
        checkpoint.resume_run_id(state, 2, "g1") == checkpoint.resume_run_id(state, 2, "") == ranks
    )
    assert checkpoint.resume_run_id(state, 1, "g1") not in ("", ranks)
    assert ranks == resume_run_id("r1", 2)


def test_a_loaded_state_must_be_this_group_s_and_this_rank_s() -> None:
    base = {"version": 1, "queue": "q", "run": "r1", "fingerprint": "f", "shards": 2,
            "epoch": 0, "consumed": {}, "done": []}  # fmt: skip
    mine = ServerDataStream(("x",), url="redis://127.0.0.1:1/0", queue="q", group="g1")
    assert checkpoint.load_state(base | {"group": "g1"}, mine.options)["run"] == "r1"
    with pytest.raises(ConfigError, match="state is of group 'g2'"):
        checkpoint.load_state(base | {"group": "g2"}, mine.options)
    rank1 = ServerDataStream(("x",), url="redis://127.0.0.1:1/0", queue="q", rank=1, world_size=2)
    with pytest.raises(ConfigError, match="state of rank 0 of world_size 1 given to rank 1"):
        checkpoint.load_state(base, rank1.options)


def test_a_rank_keeps_its_remap_while_in_the_re_split_epoch() -> None:
    old = two_ranks_in_epoch_2()
    resumed = elastic_state(old, 1, 3)
    url = "redis://127.0.0.1:1/0"
    options = ServerDataStream(("x",), url=url, queue="q", rank=1, world_size=3).options
    args = (options, "r2", None, 2)
    inside = stream_state(*args, (2, {0: 1}, []), step=7, plan_shards=6, params=None,
                          resumed=resumed)  # fmt: skip
    assert inside["remap"] == resumed["remap"] == [[2, 0], [3, 0], [4, 0], [5, 0], [2, 0], [3, 0]]
    assert "resplit" not in inside  # the ranks moved on: each sends its own pairs
    assert check_state(inside, "q") == inside
    past = stream_state(*args, (3, {}, []), step=9, plan_shards=6, params=None, resumed=resumed)
    assert "remap" not in past


def test_a_rank_s_state_stands_for_every_rank_where_only_the_last_shard_is_short() -> None:
    # 5 shards of 5 batches, the last of 2 (E = 22): each rank's position follows from
    # the plan and the batches yielded of the epoch, which the state carries.
    meta = {b"shards": b"5", b"epoch_batches": b"22", b"shard_batches": b"5", b"hwm": b"4"}
    url = "redis://127.0.0.1:1/0"
    options = ServerDataStream(("x",), url=url, queue="q", rank=0, world_size=2).options
    position = (0, {0: 5, 1: 5, 2: 2}, [0, 1, 2])
    saved = stream_state(options, "r", Plan(meta), 3, position, step=13, plan_shards=5,
                         params=None, yielding=(0, 13))  # fmt: skip
    assert (saved["every_rank"], saved["yielding"]) == (True, [0, 13])
    assert (saved["shard_batches"], saved["epoch_batches"]) == (5, 22)
    assert set(saved) <= KNOWN and check_state(saved, "q") == saved
    unordered = ServerDataStream(
        ("x",), url=url, queue="q", rank=0, world_size=2, ordered=False
    ).options
    plain = stream_state(unordered, "r", Plan(meta), 3, position, step=13, plan_shards=5,
                         params=None, yielding=(0, 13))  # fmt: skip
    assert "every_rank" not in plain and "yielding" not in plain
    uneven = Plan(meta | {b"epoch_batches": b"25", b"shard_batches": b"4"})  # not one short
    assert "every_rank" not in stream_state(
        options, "r", uneven, 3, position, step=13, plan_shards=5, params=None
    )
    assert checkpoint.resumed_batches(saved, 0) == 12  # its own share: 5 + 5 + 2
    assert checkpoint.resumed_batches(saved, 1) == checkpoint.resumed_batches(None, 0) == 0


def test_a_rank_inside_or_just_past_a_re_split_epoch_stands_for_no_other() -> None:
    # Resumed 2 -> 3 into a re-split epoch 2: its counts are the remap's, not the plan's.
    old = two_ranks_in_epoch_2()
    resumed = elastic_state(old, 0, 3)
    meta = {b"shards": b"6", b"epoch_batches": b"27", b"shard_batches": b"5", b"hwm": b"4"}
    url = "redis://127.0.0.1:1/0"
    options = ServerDataStream(("x",), url=url, queue="q", rank=0, world_size=3).options
    args = (options, "r2", Plan(meta), 2)
    # Its share of the re-split epoch done, the others still in it (its run-time pads).
    padding = stream_state(*args, (3, {}, []), step=9, plan_shards=6, params=None,
                           resumed=resumed, yielding=(2, 3))  # fmt: skip
    assert "every_rank" not in padding and "yielding" not in padding
    assert checkpoint.resumed_batches(resumed, 2) == 0  # the remap's counts are not its own
    # That epoch ended for every rank: the next one's state stands for all again.
    past = stream_state(*args, (3, {}, []), step=9, plan_shards=6, params=None,
                        resumed=resumed, yielding=(3, 0))  # fmt: skip
    assert (past["every_rank"], past["yielding"]) == (True, [3, 0])


@pytest.mark.parametrize("remap", [[[1]], [[True, 0]], [[1, -1]], "x"])
def test_a_malformed_remap_is_refused_naming_it(remap: object) -> None:
    state = checkpoint.position_state("q", "r1", "fp", 4, 2, {}, [])
    with pytest.raises(ConfigError, match=rf"state\['remap'\] = {re.escape(repr(remap))} is not"):
        check_state(state | {"remap": remap}, "q")


def test_published_counts_a_resume_dropped_come_from_the_state_it_resumed_from() -> None:
    # A Filter's plan (no epoch_batches): the ranks' published counts are the state's. A
    # resume drops those published before it and each rank says its own again only as
    # it reads: a state taken between takes what is not said from the resumed state (a
    # reviewer's rank 1 put 5 batches into its shard 0 of 2).
    meta = {b"shards": b"10", b"shard_batches": b"2", b"hwm": b"4"}
    url = "redis://127.0.0.1:1/0"
    options = ServerDataStream(("x",), url=url, queue="q", rank=0, world_size=2).options
    resumed = {"yielding": [0, 5], "shard_counts": [[2, 2, 2], [2, 1, 1, 0, 2]]}
    position = (0, {0: 2, 1: 2, 2: 1}, [0, 1])

    def state(published: list[list[int | None]], at: tuple[int, int]) -> dict[str, Any]:
        return stream_state(options, "r", Plan(meta), 5, position, step=5, plan_shards=10,
                            params=None, resumed=resumed, yielding=at,
                            published=lambda epoch: published)  # fmt: skip

    assert state([[], []], (0, 5))["shard_counts"] == resumed["shard_counts"]
    fresher = state([[2, 2, 2, 2], [None, 1]], (0, 5))["shard_counts"]
    assert fresher == [[2, 2, 2, 2], [2, 1, 1, 0, 2]]
    assert state([[], []], (1, 0))["shard_counts"] == [[], []]  # another epoch's: its own
    skip = ServerDataStream(
        ("x",), url=url, queue="q", rank=0, world_size=2, on_producer_error="skip"
    ).options
    alike = Plan(meta | {b"epoch_batches": b"10", b"shard_batches": b"1"})  # one batch a shard
    marked = stream_state(skip, "r", alike, 5, position, step=5, plan_shards=10, params=None)
    assert marked["every_rank"] is True  # as before: its slots alike, nothing published
