"""Stripes compose (issue 38): a queue striped 2 ways read by several groups, and steered
by ``set_params``, against a real redis-server with producer processes, one of them
SIGKILLed mid-epoch; every epoch exact.

A plain redis-server holds both stripes (each is a queue of its own, in a slot of its
own: a cluster is not needed for the arithmetic tested here).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import builds, examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.monitoring.rows import queue_status
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys, slot_suffix
from batchq.protocol.params_log import thaw
from consumer import ServerDataStream

STRIPES = 2
EXAMPLES, BATCH = 400, 10  # 40 batches (one shard each) per epoch, 20 per stripe
PER_EPOCH = EXAMPLES // BATCH
EPOCHS = 3
HWM = 4
PAD_BYTES = 300_000  # frames stored by reference


def reference(epochs: int = EPOCHS) -> list[list[Any]]:
    """What every trainer must read: each epoch once, in plan order."""
    stream = numbered(EXAMPLES, BATCH)
    return [[e, examples_of(f)] for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def stripes_of(queue: str) -> list[QueueKeys]:
    """Every stripe's keys (stripe 0: the queue's)."""
    return [QueueKeys(queue).stripe(k, STRIPES) for k in range(STRIPES)]


@pytest.fixture
def striped(redis_client: redis.Redis, queue_name: str) -> Iterator[list[QueueKeys]]:
    """Every stripe's keys, and those of the queues ``<queue>a`` and ``<queue>b``: all
    deleted afterwards (the fixture ``queue_name`` deletes only the queue's own)."""
    yield stripes_of(queue_name)
    for queue in (queue_name, f"{queue_name}a", f"{queue_name}b"):
        for keys in stripes_of(queue):
            delete_queue(redis_client, keys.queue)


def claim_lapsed(client: redis.Redis, keys: QueueKeys, group: str) -> bool:
    """Whether a group's claim on one stripe has passed its deadline (the server's
    clock)."""
    slot = int(client.hget(keys.groups, group) or 0)
    sec, usec = client.time()
    deadline = int(client.hget(keys.meta, "claim_deadline" + slot_suffix(slot)) or 0)
    return deadline < sec * 1000 + usec // 1000


def registered(client: redis.Redis, stripes: list[QueueKeys], n: int) -> bool:
    """Whether ``n`` groups have registered in every stripe's run."""
    return all(int(client.hlen(keys.groups)) >= n for keys in stripes)


@pytest.mark.timeout(120)
def test_two_groups_read_a_striped_queue_exactly_built_once_through_a_producer_kill(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3, build_log=log)
    groups = ("g0", "g1")
    outs = {g: tmp_path / f"{g}.jsonl" for g in groups}

    def trainer(g: str) -> Any:
        argv = train_argv(redis_url, queue_name, outs[g], EPOCHS, "--group", g, "--finish")
        return spawn_proc(argv, env=env)

    trainers = {g: trainer(g) for g in groups}
    wait_until(lambda: registered(redis_client, striped[:1], 2), timeout_s=60, what="2 groups")
    serve = serve_argv("--hwm", str(HWM), "--stripes", str(STRIPES), "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    wait_until(
        lambda: min(len(lines(outs[g])) for g in groups) >= PER_EPOCH + 8,
        timeout_s=60,
        what="every group in epoch 1",
    )
    assert registered(redis_client, striped, 2)  # each group holds a slot of every stripe
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases in both stripes
    producers[0].wait(timeout=10)
    for g, proc in trainers.items():
        assert proc.wait(timeout=90) == 0, g
    assert producers[1].wait(timeout=30) == 0  # the run ended in every stripe: it exits 0

    expected = reference()
    for g in groups:
        assert [list(x) for x in lines(outs[g])] == expected, g
    # Built once for both groups: each stripe's rebuilds are what the kill forced.
    redone = sum(int(redis_client.hget(k.stats, "redone_shards") or 0) for k in striped)
    counts = Counter(builds(str(log)))
    batches = {tuple(b) for _, b in expected}
    assert all(counts[b] >= 1 for b in batches)
    wanted = sum(counts[b] for b in batches)
    assert len(expected) <= wanted <= len(expected) + redone
    assert wanted < 2 * len(expected)
    # The run ended in every stripe: no frame, data list or reference count is left.
    for keys in striped:
        found = [k.decode() for k in redis_client.scan_iter(match=keys.pattern, count=1000)]
        assert [k for k in found if ":frame:" in k or ":data" in k or k == keys.refs] == []


def expected_params(calls: list[tuple[int, dict[str, Any]]], index: int) -> dict[str, Any]:
    """The params at ``index``: every change at or before it, in (index, call) order."""
    out: dict[str, Any] = {}
    for _, update in sorted(((i, n), u) for n, (i, u) in enumerate(calls) if i <= index):
        out.update(update)
    return out


@pytest.mark.timeout(120)
def test_set_params_on_a_striped_queue_applies_exactly_in_every_stripe_through_a_kill(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
    env["BATCHQ_TRANSPORT"] = "redis"  # frames in the lists, whose headers the test reads
    argv = serve_argv(
        "--hwm", str(HWM), "--stripes", str(STRIPES), "--heartbeat-ttl-s", "10",
        factory="pipelines:steered",
    )  # fmt: skip
    producers = [spawn_proc(argv, env=env) for _ in range(3)]

    def pushed() -> int:
        """Frames pushed into every stripe (before the kill, each batch once)."""
        return sum(int(redis_client.hget(keys.stats, "pushed") or 0) for keys in striped)

    calls: list[tuple[int, dict[str, Any]]] = []
    got: list[list[Any]] = []
    stream = ServerDataStream(
        ("features", "targets", "params"), url=redis_url, queue=queue_name, stall_s=1.0,
        transport="redis",
    )  # fmt: skip
    step = 0
    for epoch in range(EPOCHS):
        for features, _, params in stream.get_epoch_iterator():
            # The batch at index `step` was built with the params in effect there.
            assert json.loads(params) == expected_params(calls, step), f"batch {step}"
            assert thaw(stream.params) == json.loads(params)
            got.append([epoch, examples_of(features)])
            step += 1
            if step == 5:
                # D: each of the 2 stripes mints W = 2 x hwm of its shards ahead.
                lookahead = queue_status(redis_client, queue_name)["lookahead_batches"]
                assert lookahead == 2 * STRIPES * 2 * HWM
                index = stream.set_params({"level": 1})
                assert index == step + lookahead
                calls.append((index, {"level": 1}))
            elif step == 10:
                # Batches 0..11 are 12: a 14th frame pushed is a batch past 12, built
                # with the params before the change.
                wait_until(lambda: pushed() >= 14, timeout_s=30, what="past 12 built")
                update = {"level": 2, "tag": "x"}  # retroactive: before the change at 37
                assert stream.set_params(update, at_batch=12) == 12
                calls.append((12, update))
            elif step == 15:
                os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch
            elif step == 33:
                assert stream.set_params({"level": 3}, at_epoch=1) == 40
                calls.append((40, {"level": 3}))
    stream.close(finished=True)
    assert got == reference()  # every epoch exact
    assert calls[0][0] == 37
    # Every stripe's log has the three changes; the frames dropped (built ahead with
    # older params, in both stripes) were counted once.
    rows = [queue_status(redis_client, keys.queue) for keys in striped]
    assert [row["params_version"] for row in rows] == [3] * STRIPES
    rebuilt = stream.stats["rebuilt_params"]
    assert rebuilt >= 2 and sum(row["rebuilt_params"] for row in rows) == rebuilt


def steer_argv(url: str, queue: str, out: Path, *extra: str) -> list[str]:
    """tests/support/steer_train.py: set_params at steps 7 (at_batch=9) and 25."""
    script = str(Path(__file__).resolve().parents[1] / "support" / "steer_train.py")
    return [sys.executable, script, "--url", url, "--queue", queue, "--epochs", "3",
            "--out", str(out), *extra]  # fmt: skip


@pytest.mark.timeout(120)
def test_a_striped_run_steered_and_resumed_from_a_checkpoint_is_byte_identical(
    redis_url: str,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=200, batch_size=BATCH, slow_ms=1)

    def producers(queue: str) -> list[Any]:
        argv = serve_argv(
            "--hwm", str(HWM), "--stripes", str(STRIPES), "--heartbeat-ttl-s", "5",
            factory="pipelines:steered",
        )  # fmt: skip
        argv[argv.index("--queue") + 1] = queue
        return [spawn_proc(argv, env=env) for _ in range(2)]

    def read(path: Path) -> list[list[Any]]:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    # Run A: changes at steps 7 (at_batch=9) and 25 (the default index), 3 epochs.
    out_a = tmp_path / "a.jsonl"
    producers(f"{queue_name}a")
    assert spawn_proc(steer_argv(redis_url, f"{queue_name}a", out_a)).wait(timeout=60) == 0
    # Run B: the same loop, its checkpoint at step 20; a producer SIGKILLed mid-epoch,
    # then the trainer at step 30 (after the step-25 call); resumed from the step-20
    # checkpoint, it makes the step-25 call again.
    out_b, out_c, state = tmp_path / "b.jsonl", tmp_path / "c.jsonl", tmp_path / "s.json"
    served = producers(f"{queue_name}b")
    first = spawn_proc(
        steer_argv(redis_url, f"{queue_name}b", out_b, "--state-out", str(state),
                   "--state-at", "20", "--hold-at", "30")
    )  # fmt: skip
    wait_until(lambda: len(read(out_b)) >= 12, timeout_s=30, what="run B at step 12")
    os.killpg(served[0].pid, signal.SIGKILL)  # mid-epoch, holding leases in both stripes
    wait_until(lambda: len(read(out_b)) >= 30, timeout_s=30, what="run B at step 30")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    resumed = spawn_proc(steer_argv(redis_url, f"{queue_name}b", out_c, "--state-in", str(state)))
    assert resumed.wait(timeout=60) == 0
    a, b, c = read(out_a), read(out_b), read(out_c)
    assert len(a) == 60 and b[:30] == a[:30]
    assert c == a[20:]  # byte-identical from step 20 on
    # Line i is the batch at index i: the changes applied at 9 and at 25 + D = 57 (D:
    # 2 stripes x W = 8 shards ahead, twice).
    assert [json.loads(a[i][3]) for i in (8, 9, 56, 57)] == [
        {}, {"level": 1}, {"level": 1}, {"level": 2, "aug": 0.5},
    ]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restart", ["checkpoint", "no_state"])
def test_a_group_killed_and_restarted_on_a_striped_queue_reads_exact_epochs(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    restart: str,
) -> None:
    # Frames above 256 KiB, through Redis: stored by reference, once for both groups
    # (a group resumed in a live run must leave the other's alone).
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2, pad_bytes=PAD_BYTES)
    env["BATCHQ_TRANSPORT"] = "redis"
    outs = {g: tmp_path / f"{g}.jsonl" for g in ("a", "c1", "c2")}
    state = tmp_path / "c.state.json"

    def trainer(group: str, out: Path, *extra: str) -> Any:
        argv = train_argv(redis_url, queue_name, out, EPOCHS, "--group", group, "--finish")
        return spawn_proc([*argv, *extra], env=env)

    other = trainer("a", outs["a"])
    first = trainer("c", outs["c1"], "--state-out", str(state))
    wait_until(lambda: registered(redis_client, striped[:1], 2), timeout_s=60, what="2 groups")
    serve = serve_argv("--hwm", str(HWM), "--stripes", str(STRIPES), "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    wait_until(lambda: len(lines(outs["c1"])) >= PER_EPOCH + 5, timeout_s=60, what="c in epoch 1")
    os.killpg(first.pid, signal.SIGKILL)  # its claims lapse; a waits for it (no max_lag)
    first.wait(timeout=10)
    saved = json.loads(state.read_text())
    at = saved["epoch"] * PER_EPOCH + sum(saved["consumed"].values())
    if restart == "checkpoint":  # exactly where it was, in every stripe
        second = trainer("c", outs["c2"], "--state-in", str(state))
    else:  # from epoch 0 again in every stripe, as a group that joins late
        wait_until(lambda: all(claim_lapsed(redis_client, k, "c") for k in striped), what="lapse")
        second = trainer("c", outs["c2"])
    wait_until(lambda: len(lines(outs["c2"])) >= 10, timeout_s=60, what="c read again")
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases
    producers[0].wait(timeout=10)
    assert other.wait(timeout=90) == 0 and second.wait(timeout=90) == 0
    assert producers[1].wait(timeout=30) == 0  # the run ended in every stripe
    expected = reference()
    assert [list(x) for x in lines(outs["a"])] == expected
    again = [list(x) for x in lines(outs["c2"])]
    if restart == "checkpoint":
        assert [list(x) for x in lines(outs["c1"])][:at] + again == expected
    else:
        assert again == expected
