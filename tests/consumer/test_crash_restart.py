"""A producer and a trainer SIGKILLed mid-epoch, then a new pair on the same queue
(issue 28): the new trainer's epochs are exact, with no state and from an older
checkpoint, through shared memory and through Redis.

The killed producer held leases minted under the killed trainer's floor, further ahead
than the new trainer's. Reaped in the new run, they were handed to it and built past the
new trainer's look-ahead window: at first the new trainer raised FrameError (impossible)
on such a frame in 20 of 20 runs (5 of each case), then it dropped them, counted as
``dropped_ahead``. Now each lease entry names its run and a reap in another run drops
them (issue 42): the new run receives no shard of the old one, ``dropped_ahead`` is 0.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import Slow, examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.errors import TrainerConflict
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

EXAMPLES, BATCH = 1200, 20  # 60 batches (shards) per epoch
PAD_BYTES = 1_570_000  # ~1.57 MB frames
KILL_AT = 22  # batches the first trainer has yielded when both are killed
STATE_AT = 10  # the older checkpoint: 12 batches before the kill
EPOCHS = 2  # the new trainer's


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def position(state: dict[str, Any]) -> int:
    """Batches consumed before a state (ordered: a prefix of each epoch)."""
    return state["epoch"] * (EXAMPLES // BATCH) + sum(state["consumed"].values())


def claim_lapsed(client: redis.Redis, queue: str) -> bool:
    """Whether the queue's trainer claim has passed its deadline (by the server's clock)."""
    sec, usec = client.time()
    deadline = int(client.hget(QueueKeys(queue).meta, "claim_deadline") or 0)
    return deadline < sec * 1000 + usec // 1000


@pytest.mark.timeout(60)
def test_a_trainer_restarted_at_once_takes_the_claim_of_the_one_that_died(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    """Issue 39: a restart right after a crash met the dead trainer's claim until it
    lapsed (TrainerConflict). Its connections were named; none is open, so the claim is
    taken at once, long before its 60 s lapse, and a live trainer still conflicts."""
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
    spawn_proc(serve_argv("--hwm", "4"), env=env)
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ttl = ["--claim-ttl-s", "60"]
    first = spawn_proc(train_argv(redis_url, queue_name, out_a, 50, *ttl), env=env)
    wait_until(lambda: len(lines(out_a)) >= 5, timeout_s=30, what="the first trainer")
    meta = QueueKeys(queue_name).meta
    holder = redis_client.hget(meta, "claim_client")
    assert holder and holder.decode().startswith("bq-trainer-")
    other = ServerDataStream(("features",), url=redis_url, queue=queue_name, timeout_s=10)
    with other, pytest.raises(TrainerConflict, match="held by another trainer"):
        other.get_epoch_iterator()  # the first trainer lives: its claim holds
    old_run = redis_client.hget(meta, "run")
    old_deadline = int(redis_client.hget(meta, "claim_deadline") or 0)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    second = spawn_proc(train_argv(redis_url, queue_name, out_b, 2, *ttl, "--finish"), env=env)
    wait_until(lambda: redis_client.hget(meta, "run") != old_run, timeout_s=30, what="a new run")
    sec, usec = redis_client.time()
    assert sec * 1000 + usec // 1000 < old_deadline  # taken while the dead claim held
    assert second.wait(timeout=40) == 0
    assert lines(out_b) == reference(2)  # a new run (no state), exact


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["auto", "redis"])
@pytest.mark.parametrize("restart", ["no_state", "older_checkpoint"])
def test_a_trainer_restarted_after_a_crash_reads_exact_epochs(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    transport: str,
    restart: str,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2, pad_bytes=PAD_BYTES)
    env["BATCHQ_TRANSPORT"] = transport  # both sides read it
    serve = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "10")
    out_a, out_b, state = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "s.json"
    producer = spawn_proc(serve, env=env)
    extra = ["--state-out", str(state), "--state-at", str(STATE_AT)]
    trainer = spawn_proc(train_argv(redis_url, queue_name, out_a, 50, *extra), env=env)
    wait_until(lambda: len(lines(out_a)) >= KILL_AT, timeout_s=60, what="the first trainer")
    for proc in (producer, trainer):  # the producer first, then the trainer
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    saved = json.loads(state.read_text())
    assert position(saved) == STATE_AT
    figures = tmp_path / "figures.json"
    if restart == "no_state":
        # A trainer without state waits for the killed one's claim to lapse (else
        # TrainerConflict) and then starts a new run.
        wait_until(lambda: claim_lapsed(redis_client, queue_name), what="the claim to lapse")
        extra = ["--finish", "--figures", str(figures)]
    else:
        extra = ["--state-in", str(state), "--finish", "--figures", str(figures)]
    meta = QueueKeys(queue_name).meta
    old_run = redis_client.hget(meta, "run")
    trainer = spawn_proc(train_argv(redis_url, queue_name, out_b, EPOCHS, *extra), env=env)
    # The new producer joins the new trainer's run: the killed producer, still
    # registered with its leases, is reaped in that run.
    wait_until(lambda: redis_client.hget(meta, "run") != old_run, what="the new run")
    spawn_proc(serve, env=env)
    assert trainer.wait(timeout=120) == 0
    if restart == "no_state":
        assert lines(out_b) == reference(EPOCHS)
    else:
        assert lines(out_a)[: position(saved)] + lines(out_b) == reference(EPOCHS)
    # Nothing of the old run reached the new one: no frame past the window to drop.
    assert json.loads(figures.read_text())["dropped_ahead"] == 0


def test_a_shard_handed_back_past_the_window_is_dropped_counted_and_built_again(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    keys = QueueKeys(queue_name)
    local = numbered(60, 10)  # 6 shards an epoch; the run's cap 2, its window 4
    producer_thread(Slow(numbered(60, 10), slowdown=0.01), hwm=2)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, timeout_s=20
    ) as stream:
        it = stream.get_epoch_iterator()
        got = [examples_of(next(it)[0])]
        # A shard handed back far ahead of the trainer (what reap.lua did with a killed
        # producer's lease of the run before, until issue 42; the trainer still guards
        # against it): epoch 5 shard 2 goes to the work list, and the producer builds it
        # next. The trainer's floor cannot pass the shards minted so far, so it arrives
        # far past the window.
        redis_client.lpush(keys.work, 5 * 6 + 2)
        got += [examples_of(f) for f, _ in it]
        for _ in range(5):
            got += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        assert stream.stats["dropped_ahead"] == 1
        stream.close(finished=True)
    assert got == [examples_of(f) for _ in range(6) for f, _ in local.get_epoch_iterator()]
    assert int(redis_client.hget(keys.stats, "dropped_ahead") or 0) == 1
