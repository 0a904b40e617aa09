"""Data-parallel trainers: N ranks on one queue, equal disjoint shares, exact resume."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from data_parallel import (
    BATCH,
    EXAMPLES,
    check_elastic_resume,
    check_epoch,
    checkpoint_ranks,
    elastic_restart,
    lockstep,
    plans,
    rank_argv,
    shares,
    spawn_ranks,
)
from pipelines import examples_of, numbered, slot_shares
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.errors import ConfigError, StepMismatch, TrainerConflict, WorldSizeMismatch
from consumer import ServerDataStream


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    def start(n: int, *extra: str) -> list[Any]:
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2", *extra)
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
        return [spawn_proc(argv, env=env) for _ in range(n)]

    return start


@pytest.mark.parametrize("queue_url", ["redis", "cluster", "stripes"], indirect=True)
def test_four_ranks_three_producers_one_killed(
    queue_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    procs = producers(3)
    outs = [tmp_path / f"r{r}.jsonl" for r in range(4)]
    ranks = [
        spawn_proc(rank_argv(queue_url, queue_name, outs[r], 3, r, 4, "--finish")) for r in range(4)
    ]
    wait_until(lambda: sum(len(lines(o)) for o in outs) >= 30, timeout_s=60, what="epoch 1")
    procs[0].send_signal(signal.SIGKILL)
    for proc in ranks:
        assert proc.wait(timeout=90) == 0
    for plan, per_rank in zip(plans(3), shares(outs, 3), strict=True):
        check_epoch(plan, per_rank, 4)
    for proc in procs[1:]:  # the last rank's close(finished=True) ends the run
        assert proc.wait(timeout=30) == 0


def test_drop_cuts_every_share_to_the_shortest(
    redis_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    producers(2)
    outs = [tmp_path / f"r{r}.jsonl" for r in range(4)]
    ranks = [
        spawn_proc(rank_argv(redis_url, queue_name, outs[r], 2, r, 4, "--finish", "--even", "drop"))
        for r in range(4)
    ]
    for proc in ranks:
        assert proc.wait(timeout=90) == 0
    for plan, per_rank in zip(plans(2), shares(outs, 2), strict=True):
        assert [len(s) for s in per_rank] == [len(plan) // 4] * 4
        for r, share in enumerate(per_rank):
            assert share == plan[: 4 * (len(plan) // 4)][r::4]


def test_all_ranks_resume_exactly_from_one_step(
    redis_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    producers(2)
    world, epochs = 2, 3
    outs, saved = checkpoint_ranks(spawn_proc, redis_url, queue_name, tmp_path, epochs, world, 15)
    assert {s["step"] for s in saved} == {15}
    outs_b = [tmp_path / f"b{r}.jsonl" for r in range(world)]
    second = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_b, epochs, "--finish",
        per_rank=lambda r: ["--state-in", str(tmp_path / f"s{r}.json")],
    )  # fmt: skip
    for proc in second:
        assert proc.wait(timeout=90) == 0
    together = [tmp_path / f"t{r}.jsonl" for r in range(world)]
    for r in range(world):
        together[r].write_text(outs[r].read_text() + outs_b[r].read_text())
    for plan, per_rank in zip(plans(epochs), shares(together, epochs), strict=True):
        check_epoch(plan, per_rank, world)


def test_states_of_different_steps_are_refused(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    producers(1)
    streams = [
        ServerDataStream(
            ("features", "targets"), url=redis_url, queue=queue_name, rank=r, world_size=2
        )
        for r in range(2)
    ]
    its = [s.get_epoch_iterator() for s in streams]
    next(its[0])
    next(its[1])
    a = streams[0].state_dict()
    next(its[1])
    b = streams[1].state_dict()
    for s in streams:
        s.close()
    fresh = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=0, world_size=2
    )
    with pytest.raises(StepMismatch, match="step"):
        fresh.load_state_dict([a, b])
    # Each rank passing its own state: the second one to resume is refused.
    r0 = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=0, world_size=2
    )
    r0.load_state_dict(a)
    next(iter(r0.get_epoch_iterator()))
    r1 = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=1, world_size=2
    )
    r1.load_state_dict(b)
    with pytest.raises(StepMismatch, match=r"step 2.*step 1"):
        r1.get_epoch_iterator()
    r0.close()
    r1.close()


def test_a_live_rank_conflicts_and_world_sizes_must_agree(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    producers(1)
    a = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=1, world_size=2
    )
    next(iter(a.get_epoch_iterator()))
    b = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=1, world_size=2
    )
    with pytest.raises(TrainerConflict, match="rank 1"):
        b.get_epoch_iterator()
    c = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=0, world_size=3
    )
    with pytest.raises(WorldSizeMismatch, match=r"world_size 3.*world_size 2"):
        c.get_epoch_iterator()
    for s in (a, b, c):
        s.close()


def test_bad_rank_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="rank 2"):
        ServerDataStream(("x",), url="redis://127.0.0.1:1", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="world_size 0"):
        ServerDataStream(("x",), url="redis://127.0.0.1:1", world_size=0)
    with pytest.raises(ConfigError, match="even_batches 'cut'"):
        ServerDataStream(("x",), url="redis://127.0.0.1:1", world_size=2, even_batches="cut")


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_shards_of_several_batches_still_end_every_epoch_even(
    redis_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path, even: str
) -> None:
    # 22 batches in 8 shards of 3 (the last of 1): rank 3 gets shards 3 and 7, 4 batches;
    # the others 6.
    producers(2, "--requests-per-shard", "3")
    outs = [tmp_path / f"r{r}.jsonl" for r in range(4)]
    ranks = [
        spawn_proc(rank_argv(redis_url, queue_name, outs[r], 2, r, 4, "--finish", "--even", even))
        for r in range(4)
    ]
    for proc in ranks:
        assert proc.wait(timeout=90) == 0
    for plan, per_rank in zip(plans(2), shares(outs, 2), strict=True):
        cut = [plan[3 * s : 3 * s + 3] for s in range(8)]  # shard s's batches
        own = [cut[r] + cut[r + 4] for r in range(4)]
        if even == "pad":
            assert [len(s) for s in per_rank] == [6] * 4
            assert per_rank[3] == own[3] + own[3][:2]  # its own first batches again
            assert per_rank[:3] == own[:3]
        else:
            assert [len(s) for s in per_rank] == [4] * 4
            assert per_rank == [o[:4] for o in own]


@pytest.mark.parametrize(("old", "new", "stop"), [(4, 2, 3), (2, 3, 4)])
def test_elastic_resume_keeps_every_epoch_exact(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    old: int,
    new: int,
    stop: int,
) -> None:
    producers(2)
    epochs = 3
    outs, outs_b, second = elastic_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, old, new, stop
    )
    for proc in second:
        assert proc.wait(timeout=90) == 0
    check_elastic_resume(outs, outs_b, epochs, old, new, stop)


def test_status_exporter_and_report_show_each_rank(
    redis_url: str, queue_name: str, producer_thread: Any, redis_client: Any, tmp_path: Path
) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from batchq.monitoring.exporter import BatchqCollector
    from batchq.monitoring.rows import status_rows
    from batchq.monitoring.text import render_table

    producer_thread(numbered(EXAMPLES, BATCH))
    streams = [
        ServerDataStream(
            ("features", "targets"), url=redis_url, queue=queue_name, rank=r, world_size=2
        )
        for r in range(2)
    ]
    fast, slow = (s.get_epoch_iterator() for s in streams)
    for _ in range(8):
        next(fast)
    next(slow)
    # The pops report figures about once a second: wait for both ranks'.
    wait_until(
        lambda: all(
            r["epoch_progress"] for r in status_rows(redis_client, [queue_name])[0]["ranks"]
        ),
        timeout_s=15,
        what="both ranks' figures",
    )
    (row,) = status_rows(redis_client, [queue_name])
    assert row["world_size"] == 2
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    assert [r["trainer"] for r in row["ranks"]] == ["attached", "attached"]
    assert row["slowest_rank"] == 1
    assert "rank 1 (slowest)" in render_table([row])
    registry = CollectorRegistry()
    registry.register(BatchqCollector(redis_client, [queue_name]))
    text = generate_latest(registry).decode()
    assert f'batchq_rank_depth_items{{queue="{queue_name}",rank="1"}}' in text
    assert f'batchq_slowest_rank{{queue="{queue_name}"}} 1.0' in text
    from batchq.cli import main

    out = tmp_path / "report.png"
    assert main(["report", "--url", redis_url, "--queue", queue_name, "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    for s in streams:
        s.close()


def test_ranks_survive_redis_restarting_empty(
    tmp_path: Path, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    import threading

    from batchq.host.embedded import EmbeddedRedis

    server = EmbeddedRedis(workdir=str(tmp_path / "redis"))
    server.start()
    try:
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2")
        argv[argv.index("--url") + 1] = server.url
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
        for _ in range(2):
            spawn_proc(argv, env=env)
        got: list[list[tuple[int, list[int]]]] = [[], []]
        halfway, errors = threading.Event(), []

        def rank(r: int) -> None:
            try:
                with ServerDataStream(
                    ("features", "targets"), url=server.url, queue=queue_name, rank=r,
                    world_size=2, stall_s=1.0, timeout_s=60,
                ) as stream:  # fmt: skip
                    for _ in range(3):
                        for f, _ in stream.get_epoch_iterator():
                            got[r].append((stream.epoch, examples_of(f)))
                            if r == 0 and len(got[0]) == 15:
                                halfway.set()
                    stream.close(finished=True)
            except BaseException as e:
                errors.append(e)
                halfway.set()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        assert halfway.wait(timeout=60)
        server.kill()
        server.restart(wipe=True)
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for e, plan in enumerate(plans(3)):
            check_epoch(plan, [[b for ep, b in g if ep == e] for g in got], 2)
    finally:
        server.stop()


def test_a_rank_that_stops_never_holds_the_producers_serving_the_others(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    producers(2)  # hwm 4: rank 1's list fills as soon as it stops reading
    ranks = [
        ServerDataStream(
            ("features", "targets"), url=redis_url, queue=queue_name, rank=r, world_size=2
        )
        for r in range(2)
    ]
    quitter = ranks[1].get_epoch_iterator()
    next(quitter)
    next(quitter)
    ranks[1].close()  # its claim goes; its list stays full
    got = [[examples_of(f) for f, _ in ranks[0].get_epoch_iterator()] for _ in range(3)]
    for plan, share in zip(plans(3), got, strict=True):
        assert share == plan[0::2]  # rank 0's whole share (22 slots), every epoch
    ranks[0].close(finished=True)


def found_ranks(
    spawn_proc: Any, url: str, queue: str, outs: list[Path], epochs: int, *extra: str
) -> list[Any]:
    """One trainer process per rank that names no rank: RANK and WORLD_SIZE (torchrun's
    variables) are all it has; each saves its state after every batch beside its --out."""
    world = len(outs)
    return [
        spawn_proc(
            train_argv(url, queue, outs[r], epochs, "--state-out", f"{outs[r]}.state", *extra),
            env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)),
        )
        for r in range(world)
    ]


def rank_zero_restart(
    spawn_proc: Any,
    url: str,
    queue: str,
    tmp: Path,
    epochs: int,
    old: int,
    new: int,
    stop: int,
    *extra: str,
) -> tuple[list[Path], dict[str, Any], list[Path]]:
    """``old`` found ranks read ``stop`` batches each and stop; ``new`` found ranks then
    resume from rank 0's state alone (what Lightning and Accelerate keep) to the end.

    Returns:
        (the first job's outputs, rank 0's state, the second job's outputs).
    """
    outs = [tmp / f"a{r}.jsonl" for r in range(old)]
    for proc in found_ranks(
        spawn_proc, url, queue, outs, epochs, "--stop-after", str(stop), *extra
    ):
        assert proc.wait(timeout=60) == 3
    rank_zero = Path(f"{outs[0]}.state")
    outs_b = [tmp / f"b{r}.jsonl" for r in range(new)]
    for proc in found_ranks(
        spawn_proc, url, queue, outs_b, epochs, "--finish", "--state-in", str(rank_zero), *extra
    ):
        assert proc.wait(timeout=90) == 0
    return outs, json.loads(rank_zero.read_text()), outs_b


@pytest.mark.parametrize(("old", "new"), [(2, 2), (2, 3)])
def test_ranks_found_and_rank_zeros_state_alone_resumes_the_job(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    old: int,
    new: int,
) -> None:
    # What Lightning and Accelerate do: only rank 0's state is saved, every rank loads it.
    producers(2)
    epochs, stop = 2, 4
    outs, saved, outs_b = rank_zero_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, old, new, stop
    )
    assert (saved["rank"], saved["world_size"], saved["step"]) == (0, old, stop)
    assert saved["every_rank"] is True  # one batch per shard, plan order
    plan = plans(epochs)
    before = [b for o in outs for _, b in lines(o)]
    assert len(before) == old * stop
    after = shares(outs_b, epochs)
    units = plan[0][old * stop :]
    per = -(-len(units) // new)
    padded = units + units[: per * new - len(units)]
    assert after[0] == [padded[r::new] for r in range(new)]  # the rest of epoch 0, split
    got = Counter(tuple(b) for b in before + [b for s in after[0] for b in s])
    assert got == Counter(tuple(b) for b in plan[0] + units[: per * new - len(units)])
    check_epoch(plan[1], after[1], new)


@pytest.mark.parametrize(("old", "new"), [(2, 2), (2, 3)])
def test_rank_zeros_state_alone_resumes_the_job_where_every_shard_is_full(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    old: int,
    new: int,
) -> None:
    # 22 batches in 11 shards of 2, every one full: after the same number of batches
    # every rank's position is the same, mid-shard too (issue 39: Lightning's and
    # Accelerate's rank-0 checkpoint where shards hold several batches).
    producers(2, "--requests-per-shard", "2")
    epochs, stop = 2, 3  # stopped inside each rank's second shard
    outs, saved, outs_b = rank_zero_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, old, new, stop
    )
    assert (saved["step"], saved["consumed"]["1"], saved["every_rank"]) == (stop, 1, True)
    plan = plans(epochs)
    before = shares(outs, epochs)[0]
    assert [len(b) for b in before] == [stop] * old
    after = shares(outs_b, epochs)
    if new == old:  # every rank goes on in its own share, exactly where it was
        own = slot_shares(plan[0], 2, old)
        assert [b + a for b, a in zip(before, after[0], strict=True)] == own
    else:  # the rest of epoch 0 re-split: every batch of it yielded, equal counts
        assert len({len(a) for a in after[0]}) == 1
        read = Counter(tuple(b) for s in before + after[0] for b in s)
        assert set(read) == {tuple(b) for b in plan[0]}
    assert after[1] == slot_shares(plan[1], 2, new)  # the next epoch in the new world


@pytest.mark.parametrize(("old", "new"), [(2, 2), (2, 3)])
def test_rank_zeros_state_alone_resumes_the_job_where_the_last_shard_is_short(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    old: int,
    new: int,
) -> None:
    # 22 batches in shards of 5, the last of 2: rank 0 builds shards 0, 2, 4 (12
    # batches), rank 1 shards 1, 3 and a pad of shard 0 (15), so at one step their
    # positions differ; rank 0's state carries the batches yielded of the epoch, from
    # which every rank's own is rebuilt (issue 39).
    producers(2, "--requests-per-shard", "5")
    epochs, stop = 2, 11  # rank 0 1 batch into the short shard, rank 1 into its pad slot
    outs, saved, outs_b = rank_zero_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, old, new, stop
    )
    assert (saved["every_rank"], saved["yielding"], saved["consumed"]) == (
        True, [0, stop], {"0": 5, "1": 5, "2": 1}
    )  # fmt: skip
    plan = plans(epochs)
    before = shares(outs, epochs)[0]
    assert [len(b) for b in before] == [stop] * old
    after = shares(outs_b, epochs)
    if new == old:  # every rank goes on in its own share, exactly where it was
        own = slot_shares(plan[0], 5, old)
        assert [len(b) + len(a) for b, a in zip(before, after[0], strict=True)] == [15] * old
        assert before[0] + after[0][0][:1] == own[0]  # then 3 run-time pads
        assert before[1] + after[0][1] == own[1]
    else:  # the rest of epoch 0 re-split: every batch of it yielded, equal counts
        assert len({len(a) for a in after[0]}) == 1
        read = Counter(tuple(b) for s in before + after[0] for b in s)
        assert set(read) == {tuple(b) for b in plan[0]}
    # The next epoch in the new world: each rank's share in plan order, then its pads.
    own = slot_shares(plan[1], 5, new)
    assert [a[: len(o)] for a, o in zip(after[1], own, strict=True)] == own
    assert {len(a) for a in after[1]} == {max(map(len, own))}


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_ranks_that_step_together_end_every_epoch_where_shards_differ(
    redis_url: str, queue_name: str, producers: Any, even: str
) -> None:
    # DDP's ranks step together (the gradients' all-reduce): a barrier after every
    # batch. Shards of 5, the last of 2: with 'pad' rank 0 holds 12 batches an epoch,
    # rank 1 15; with 'drop' the last shard goes to nobody (10 each).
    # A rank that waited for another's final count would wait for a rank that waits
    # for it at the barrier (issue 39's review): the plan's counts need no wait.
    producers(2, "--requests-per-shard", "5")
    got = lockstep(redis_url, queue_name, 2, 2, even)
    count = 15 if even == "pad" else 10
    for e, plan in enumerate(plans(2)):
        shares_e = [[b for ep, b in g if ep == e] for g in got]
        own = slot_shares(plan, 5, 2) if even == "pad" else slot_shares(plan[:20], 5, 2)
        assert [len(s) for s in shares_e] == [count, count]
        assert [s[: min(count, len(o))] for s, o in zip(shares_e, own, strict=True)] == [
            o[:count] for o in own
        ]  # each rank's share in plan order, then (pad) its own first batches again


def test_ranks_that_step_together_resume_rank_zero_s_state_in_another_world(
    redis_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    # Shards of 5, the last of 2; 2 ranks read 3 batches each, 3 ranks then resume from
    # rank 0's state alone, stepping together: the re-split epoch's counts follow from
    # its remap (no rank waits for another's, which waits at the barrier).
    producers(2, "--requests-per-shard", "5")
    outs = [tmp_path / f"a{r}.jsonl" for r in range(2)]
    for proc in found_ranks(spawn_proc, redis_url, queue_name, outs, 2, "--stop-after", "3"):
        assert proc.wait(timeout=60) == 3
    state = json.loads(Path(f"{outs[0]}.state").read_text())
    got = lockstep(redis_url, queue_name, 3, 2, "pad", state)
    plan = plans(2)
    before = shares(outs, 2)[0]
    after = [[b for ep, b in g if ep == 0] for g in got]
    # The rest re-split: shards 0 and 1 from their 4th batch (2 left each), 2, 3 and 4
    # whole, then a pad of shard 0: ranks hold 2 + 5, 2 + 2 and 5 + 2, evened to 7.
    assert [len(a) for a in after] == [7, 7, 7]
    read = Counter(tuple(b) for s in before + after for b in s)
    assert set(read) == {tuple(b) for b in plan[0]}  # every batch of the epoch, pads aside
    own = slot_shares(plan[1], 5, 3)
    nxt = [[b for ep, b in g if ep == 1] for g in got]
    assert [a[: len(o)] for a, o in zip(nxt, own, strict=True)] == own


@pytest.mark.parametrize("stop", [10, 11])
def test_drop_resumes_from_rank_zero_s_state_at_the_epoch_s_last_step(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    stop: int,
) -> None:
    # Shards of 3, the last of 1 (8 shards): rank 0 holds 12 batches, rank 1 10; 'drop'
    # ends both at 10. Stopped at step 10 (the epoch's last), rank 0's state is past the
    # epoch as rank 1's is: its cut came before the batch (issue 39's review: it was
    # still inside the epoch, and the resumed job waited for counts never sent).
    producers(2, "--requests-per-shard", "3")
    epochs = 2
    outs, saved, outs_b = rank_zero_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, 2, 2, stop, "--even", "drop"
    )
    after = shares(outs_b, epochs)
    before = shares(outs, epochs)
    plan = plans(epochs)
    own = slot_shares(plan[0], 3, 2)
    assert (saved["epoch"], saved["consumed"]) == ((1, {}) if stop == 10 else (1, {"0": 1}))
    assert [b + a for b, a in zip(before[0], after[0], strict=True)] == [o[:10] for o in own]
    whole = [b + a for b, a in zip(before[1], after[1], strict=True)]
    assert whole == [o[:10] for o in slot_shares(plan[1], 3, 2)]


def test_a_rank_whose_list_fills_while_another_reads_is_unread(
    redis_url: str, queue_name: str, producer_thread: Any, redis_client: Any
) -> None:
    # Issue 39: what a wrapper reading on rank 0 only looks like from outside.
    from batchq.monitoring.rows import status_rows

    producer_thread(numbered(EXAMPLES, BATCH), hwm=4)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, rank=0, world_size=2
    ) as reading:
        next(reading.get_epoch_iterator())

        def ranks() -> list[dict[str, Any]]:
            return list(status_rows(redis_client, [queue_name])[0]["ranks"])

        wait_until(lambda: ranks()[1]["depth"] >= 3, timeout_s=20, what="rank 1's list full")
        rows = ranks()
        assert [r["trainer"] for r in rows] == ["attached", "detached"]
        assert rows[0]["verdict"] != "unread"
        assert rows[1]["verdict"] == "unread"
        assert "no trainer reads it while rank 0 reads" in rows[1]["verdict_reason"]
