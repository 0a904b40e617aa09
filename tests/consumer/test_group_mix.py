"""Groups with ranks, groups beside a trainer without group, and what a group may not do
(issue 31), against a real redis-server with producer processes."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from data_parallel import check_epoch, plans, shares
from pipelines import builds, examples_of
from train import argv as train_argv
from waiting import wait_until

from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

EXAMPLES, BATCH = 220, 10  # 22 batches (one shard each) per epoch


@pytest.mark.timeout(240)
def test_two_groups_of_two_ranks_each_read_their_shares_built_once(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2, build_log=log)
    epochs, world = 3, 2
    outs = {(g, r): tmp_path / f"{g}{r}.jsonl" for g in ("a", "b") for r in range(world)}

    def rank(g: str, r: int) -> Any:
        extra = ("--group", g, "--rank", str(r), "--world", str(world), "--finish")
        return spawn_proc(train_argv(redis_url, queue_name, outs[g, r], epochs, *extra), env=env)

    ranks = [rank(g, r) for g, r in outs]
    wait_until(lambda: redis_client.hlen(QueueKeys(queue_name).groups) == 2, what="two groups")
    producers = [spawn_proc(serve_argv("--hwm", "4"), env=env) for _ in range(2)]
    for proc in ranks:
        assert proc.wait(timeout=180) == 0
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    for g in ("a", "b"):
        per_epoch = shares([outs[g, r] for r in range(world)], epochs)
        for plan, per_rank in zip(plans(epochs), per_epoch, strict=True):
            check_epoch(plan, per_rank, world)
    # Each batch built once for both groups (the look-ahead past the last epoch aside).
    counts = Counter(builds(str(log)))
    wanted = [tuple(b) for plan in plans(epochs) for b in plan]
    assert sum(counts[b] for b in wanted) == len(wanted)


@pytest.mark.timeout(120)
def test_a_group_of_another_world_size_reads_its_own_split(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # Each group reads with its own world size (issue 38; GroupWorldMismatch before):
    # group a's rank 0 of 2 gets its share of the epoch, group b alone every batch.
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    spawn_proc(serve_argv("--hwm", "4"), env=env)
    first = ServerDataStream(
        ("features",), url=redis_url, queue=queue_name, group="a", rank=0, world_size=2
    )
    other = ServerDataStream(("features",), url=redis_url, queue=queue_name, group="b")
    plan = plans(1)[0]
    try:
        share = first.get_epoch_iterator()
        got_a = [examples_of(next(share)[0])]  # group a claims the run with world_size 2
        got_b = [examples_of(f) for (f,) in other.get_epoch_iterator()]
        got_a += [examples_of(f) for (f,) in share]
        assert got_b == plan
        assert got_a == plan[0::2]  # slots 0, 2, 4...: rank 0's share of 2
    finally:
        other.close()
        first.close()


@pytest.mark.timeout(240)
def test_a_group_joins_a_run_that_a_trainer_without_group_reads(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    # Frames of 300 KB travel by reference: the first trainer GETDELs them until the run
    # is read by several groups, and must then read them and release them (release.lua)
    # or the group would find them gone (a bad frame, missing_ref).
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2, pad_bytes=300_000)
    epochs = 3
    expected = [[e, b] for e, plan in enumerate(plans(epochs)) for b in plan]
    got: dict[str, list[list[Any]]] = {"default": [], "late": []}
    errors: list[BaseException] = []

    def read(name: str, group: str | None) -> None:
        stream = ServerDataStream(
            ("features",), url=redis_url, queue=queue_name, group=group, hwm=4, timeout_s=60
        )
        try:
            while stream.epoch + 1 < epochs:
                for (features,) in stream.get_epoch_iterator():
                    got[name].append([stream.epoch, examples_of(features)])
            stream.close(finished=True)
        except BaseException as e:
            errors.append(e)
            stream.close()

    default = threading.Thread(target=read, args=("default", None), daemon=True)
    default.start()
    producers = [spawn_proc(serve_argv("--hwm", "4"), env=env) for _ in range(2)]
    wait_until(lambda: len(got["default"]) >= 10, timeout_s=60, what="the default group")
    late = threading.Thread(target=read, args=("late", "late"), daemon=True)
    late.start()
    for t in (default, late):
        t.join(timeout=180)
        assert not t.is_alive()
    assert errors == []
    assert got["default"] == expected and got["late"] == expected
    keys = QueueKeys(queue_name)
    assert redis_client.hgetall(keys.groups) == {b"": b"0", b"late": b"1"}
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    assert list(redis_client.scan_iter(match=keys.frame_pattern)) == []


@pytest.mark.timeout(180)
def test_torch_streams_of_two_groups_share_the_segments_and_read_every_epoch(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    pytest.importorskip("torch")
    from consumer.torch import TorchStream

    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1, pad_bytes=100_000)
    env["BATCHQ_TRANSPORT"] = "auto"
    epochs = 2
    got: dict[str, list[list[Any]]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def read(group: str) -> None:
        stream = ServerDataStream(("features",), url=redis_url, queue=queue_name, group=group)
        try:
            with TorchStream(stream) as ts:  # writable views over the shared segments
                for epoch in range(epochs):
                    for (features,) in ts.get_epoch_iterator():
                        got[group].append([epoch, examples_of(features.numpy())])
                        features += 1  # in place: never shows in the other group's batch
                ts.close(finished=True)
        except BaseException as e:
            errors.append(e)

    readers = [threading.Thread(target=read, args=(g,), daemon=True) for g in ("a", "b")]
    for t in readers:
        t.start()
    wait_until(lambda: redis_client.hlen(QueueKeys(queue_name).groups) == 2, what="two groups")
    producers = [spawn_proc(serve_argv("--hwm", "4"), env=env) for _ in range(2)]
    for t in readers:
        t.join(timeout=150)
        assert not t.is_alive()
    assert errors == []
    expected = [[e, b] for e, plan in enumerate(plans(epochs)) for b in plan]
    assert got["a"] == expected and got["b"] == expected
    for proc in producers:
        assert proc.wait(timeout=30) == 0


@pytest.mark.timeout(120)
def test_set_params_is_refused_in_a_run_read_by_groups(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=EXAMPLES, batch_size=BATCH))
    stream = ServerDataStream(("features",), url=redis_url, queue=queue_name, group="a")
    try:
        next(stream.get_epoch_iterator())
        with pytest.raises(ConfigError, match="group a: set_params changes what the producers"):
            stream.set_params({"size": 64})
    finally:
        stream.close()
