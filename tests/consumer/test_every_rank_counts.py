"""One rank's state resumes every rank where the plan cannot count its shards (a Filter):
the ranks publish their shards' batch counts as they pass them, and rank 0's state
carries them (issue 39). Real producers, a real redis-server, ranks stepping together."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from data_parallel import BATCH, EXAMPLES, plans, ranks_in_step

from consumer.rank_state import pick_rank_state

# Requests a shard: 22 batches, 11 shards; filtered, epoch 0's hold 2 2 2 1 2 1 2 0 2 2 1
# batches (rank 0's shards 0, 2, ... 11 in all, rank 1's 6), so the ranks' positions at
# one step differ from the third batch on, and the plan counts none of them.
PER_SHARD = 2


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    argv = serve_argv(
        "--hwm", "4", "--heartbeat-ttl-s", "2", "--requests-per-shard", str(PER_SHARD),
        factory="pipelines:filtered",
    )  # fmt: skip
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    return [spawn_proc(argv, env=env) for _ in range(2)]


def filtered(plan: list[list[int]]) -> list[list[list[int]]]:
    """An epoch's shards of the filtered plan: PER_SHARD requests each, filtered."""
    return [
        [b for b in plan[i : i + PER_SHARD] if b[0] % 3 != 0]
        for i in range(0, len(plan), PER_SHARD)
    ]


def filtered_shares(plan: list[list[int]], world: int, even: str) -> list[list[list[int]]]:
    """Each rank's share of an epoch of the filtered plan, in plan order, evened as the
    ranks even it ('drop': cut at the fewest; 'pad': only the share, pads not listed)."""
    shards = filtered(plan)
    slots = (len(shards) // world if even == "drop" else -(-len(shards) // world)) * world
    own = [
        [b for s in range(r, slots, world) for b in shards[s % len(shards)]] for r in range(world)
    ]
    count = min(map(len, own))
    return [o[:count] for o in own] if even == "drop" else own


def re_split_rest(plan: list[list[int]], remap: list[list[int]], new: int) -> list[list[list[int]]]:
    """'drop': the rest of an epoch re-split for ``new`` ranks by ``remap`` (slot u:
    [shard, batches had], rank u % new): each rank's units from their next batch, in
    order, cut at the fewest."""
    shards = filtered(plan)
    own = [[b for shard, had in remap[r::new] for b in shards[shard][had:]] for r in range(new)]
    return [o[: min(map(len, own))] for o in own]


def epoch_of(got: list[list[tuple[int, list[int]]]], epoch: int) -> list[list[list[int]]]:
    return [[b for e, b in g if e == epoch] for g in got]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stop", "group"), [(3, None), (5, None), (6, None), (5, "g1")])
def test_drop_ranks_stepping_together_resume_from_rank_zero_s_state_exactly(
    redis_url: str, queue_name: str, producers: Any, stop: int, group: str | None
) -> None:
    # DDP's ranks step together ('drop': a Filter's run-time counts need it): rank 0's
    # state alone, taken `stop` batches in, resumes both ranks where each was, so the two
    # runs together are the uninterrupted run, batch for batch. At 6, epoch 0's count
    # (rank 1's whole share), both resume in epoch 1: rank 0 had not cut its longer
    # share yet (a reviewer's finding). A group's resume starts its counts afresh (they
    # were the run's before: an in-hand count of 5 let a rank past the cut).
    got, saved = ranks_in_step(redis_url, queue_name, 2, 2, "drop", stop=stop, group=group)
    assert saved is not None and saved["every_rank"] is True
    assert saved["yielding"] == [0, stop] and saved["shard_counts"][1][:2] == [2, 1]
    # Rank 1 is elsewhere in its share than rank 0: its position is rebuilt, not copied.
    rebuilt = [pick_rank_state(saved, r, 2) for r in range(2)]
    if stop == 6:
        assert [(s["epoch"], s["consumed"]) for s in rebuilt] == [(1, {}), (1, {})]
    else:
        assert rebuilt[1]["done"][:2] == [0, 1] and rebuilt[0]["done"][:1] == [0]
        assert len(rebuilt[1]["done"]) > len(rebuilt[0]["done"])  # shard 3 holds 1 batch
    after, _ = ranks_in_step(redis_url, queue_name, 2, 2, "drop", state=saved, group=group)
    plan = plans(2)
    whole = [b + a for b, a in zip(epoch_of(got, 0), epoch_of(after, 0), strict=True)]
    assert whole == filtered_shares(plan[0], 2, "drop")
    assert epoch_of(after, 1) == filtered_shares(plan[1], 2, "drop")


@pytest.mark.timeout(120)
def test_drop_ranks_resume_rank_zero_s_state_in_another_world(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    # 2 ranks read 3 batches each; 3 ranks resume from rank 0's state alone: every rank's
    # position rebuilt from the published counts, the rest of the epoch re-split.
    got, saved = ranks_in_step(redis_url, queue_name, 2, 2, "drop", stop=3)
    assert saved is not None
    after, _ = ranks_in_step(redis_url, queue_name, 3, 2, "drop", state=saved)
    plan = plans(2)
    remap = pick_rank_state(saved, 0, 3)["remap"]
    # Every shard not yielded completely (2 from its 2nd batch), none known to be empty
    # (shard 7 is, once rank 1 had its END): 2 units each, the rest dropped.
    assert remap[0] == [2, 1]
    assert [shard for shard, _ in remap] in ([2, 4, 5, 6, 7, 8], [2, 4, 5, 6, 8, 9])
    assert epoch_of(after, 0) == re_split_rest(plan[0], remap, 3)
    read = Counter(tuple(b) for s in epoch_of(got, 0) + epoch_of(after, 0) for b in s)
    assert max(read.values()) == 1  # 'drop' pads nothing: no batch twice
    assert epoch_of(after, 1) == filtered_shares(plan[1], 3, "drop")


@pytest.mark.timeout(120)
def test_pad_ranks_resume_from_rank_zero_s_state_exactly(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    # 'pad' where ranks do not wait on each other every batch (a Filter's pads need each
    # rank's final count): all at step 4, rank 0's state resumes both in their shares.
    got, saved = ranks_in_step(redis_url, queue_name, 2, 2, "pad", stop=4, every_batch=False)
    assert saved is not None and saved["every_rank"] is True
    after, _ = ranks_in_step(redis_url, queue_name, 2, 2, "pad", state=saved, every_batch=False)
    plan = plans(2)
    own = filtered_shares(plan[0], 2, "pad")
    count = max(map(len, own))
    for before, rest, share in zip(epoch_of(got, 0), epoch_of(after, 0), own, strict=True):
        assert len(before) + len(rest) == count
        assert (before + rest)[: len(share)] == share  # its share exactly, then pads
    nxt = epoch_of(after, 1)
    own = filtered_shares(plan[1], 2, "pad")
    assert [n[: len(o)] for n, o in zip(nxt, own, strict=True)] == own
