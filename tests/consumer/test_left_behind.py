"""Nothing of a run is left behind (issue 42), against a real redis-server with producer
and trainer processes.

- A run read by three groups leaves only its records once it ended: the keys that
  ``batchq status`` and ``report`` read afterwards (meta, counters, figures, history, the
  group registry), none of its lists (per-group wake lists were left before).
- A producer SIGKILLed mid-run leaves its lease list; the next run (a trainer without
  state) drops it instead of building those shards: before, reap.lua and gone.lua handed
  them to the new run, which built them past the new trainer's window (dropped and
  counted as ``dropped_ahead``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import redis
from pipelines import examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.protocol.keys import QueueKeys
from batchq.wire.shm import DEFAULT_SHM_DIR, list_segments

EXAMPLES, BATCH = 200, 10  # 20 batches (one shard each) per epoch
EPOCHS = 2
PAD_BYTES = 300_000  # frames above 256 KiB: stored by reference, once for every group


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def queue_keys(client: redis.Redis, queue: str) -> set[str]:
    """Every key of the queue in Redis."""
    pattern = QueueKeys(queue).pattern
    return {k.decode() for k in client.scan_iter(match=pattern, count=1000)}


def records(keys: QueueKeys, slots: int) -> set[str]:
    """What a finished run of ``slots`` group slots (one rank each) keeps: the queue's
    meta and incarnation, the producers' counters, and each slot's counters, figures and
    history (docs/design.md, "Several groups": what a run leaves), and the group
    registry where groups read it."""
    kept = {keys.meta, keys.incarnation, keys.pstats}
    for slot in range(slots):
        view = keys.slot_view(slot)
        kept |= {view.stats, view.trainer, view.history}
    return kept | ({keys.groups} if slots > 1 else set())


def test_a_run_read_by_three_groups_leaves_only_its_records(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3, pad_bytes=PAD_BYTES)
    env["BATCHQ_TRANSPORT"] = "redis"
    groups = ("g0", "g1", "g2")
    outs = {g: tmp_path / f"{g}.jsonl" for g in groups}
    trainers = {
        g: spawn_proc(
            train_argv(redis_url, queue_name, outs[g], EPOCHS, "--group", g, "--finish"), env=env
        )
        for g in groups
    }
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.hlen(keys.groups) == 3, timeout_s=60, what="3 groups")
    producers = [spawn_proc(serve_argv("--hwm", "4"), env=env) for _ in range(2)]
    for g, proc in trainers.items():
        assert proc.wait(timeout=120) == 0, g
    for proc in producers:
        assert proc.wait(timeout=30) == 0  # the run ended: they exit 0
    for g in groups:
        assert lines(outs[g]) == reference(EPOCHS), g
    assert redis_client.hget(keys.meta, "finished") == b"1"
    assert queue_keys(redis_client, queue_name) == records(keys, 3)
    assert list_segments(DEFAULT_SHM_DIR, queue_name) == []


def frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP reached it): /proc says 'T'."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def connected(client: redis.Redis, ids: set[int]) -> bool:
    """Whether Redis still serves any of the connections ``ids`` (a dead producer's until
    Redis noticed they closed, and ran what they had sent)."""
    return any(int(c["id"]) in ids for c in client.client_list())


def test_a_killed_producers_leases_never_reach_the_next_run(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    keys = QueueKeys(queue_name)
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
    serve = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "10")
    out_a, out_b, figures = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "b.json"
    producer = spawn_proc(serve, env=env)
    first = spawn_proc(train_argv(redis_url, queue_name, out_a, 50), env=env)
    wait_until(lambda: len(lines(out_a)) >= 25, timeout_s=60, what="the first trainer")
    os.killpg(first.pid, signal.SIGKILL)  # 25 batches in: the run's floor is in epoch 1
    first.wait(timeout=10)
    # The producer fills the list and holds leases: freeze it holding some, then kill it.
    lease_keys: list[str] = []

    def holding() -> bool:
        os.killpg(producer.pid, signal.SIGSTOP)
        wait_until(lambda: frozen(producer.pid), timeout_s=10, what="the producer to stop")
        lease_keys[:] = [k.decode() for k in redis_client.scan_iter(match=f"{keys.base}:lease:*")]
        if lease_keys and all(redis_client.llen(k) for k in lease_keys):
            return True
        os.killpg(producer.pid, signal.SIGCONT)
        return False

    wait_until(holding, timeout_s=30, what="the producer to hold leases")
    ids = {int(v) for v in redis_client.hvals(keys.clients)}
    os.killpg(producer.pid, signal.SIGKILL)
    producer.wait(timeout=10)
    wait_until(lambda: not connected(redis_client, ids), what="Redis to drop its connections")
    (lease_key,) = lease_keys
    held = [e.decode() for e in redis_client.lrange(lease_key, 0, -1)]
    old_run = redis_client.hget(keys.meta, "run")
    assert held and all(e.split(":")[1] == old_run.decode() for e in held)  # its entries
    # Past the new trainer's window: handed over, they were built and dropped before.
    assert min(int(e.split(":")[0]) for e in held) >= 25
    before = redis_client.hgetall(keys.stats)

    def claim_lapsed() -> bool:
        sec, usec = redis_client.time()
        deadline = int(redis_client.hget(keys.meta, "claim_deadline") or 0)
        return deadline < sec * 1000 + usec // 1000

    wait_until(claim_lapsed, what="the killed trainer's claim to lapse")
    extra = ("--finish", "--figures", str(figures))
    second = spawn_proc(train_argv(redis_url, queue_name, out_b, EPOCHS, *extra), env=env)
    wait_until(lambda: redis_client.hget(keys.meta, "run") != old_run, what="the new run")
    survivor = spawn_proc(serve, env=env)
    # The new trainer reaps the killed producer (its connections closed) in the new run:
    # every lease it held is dropped, counted, none handed back to the new run.
    wait_until(lambda: not redis_client.exists(lease_key), what="the killed producer reaped")
    stats = redis_client.hgetall(keys.stats)
    assert int(stats[b"stale_leases"]) - int(before.get(b"stale_leases", 0)) == len(held)
    assert second.wait(timeout=120) == 0
    assert survivor.wait(timeout=30) == 0
    assert lines(out_b) == reference(EPOCHS)
    assert json.loads(figures.read_text())["dropped_ahead"] == 0
    assert int(redis_client.hget(keys.stats, "dropped_ahead") or 0) == 0
    assert queue_keys(redis_client, queue_name) == records(keys, 1)
