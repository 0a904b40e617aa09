"""A run's start: old frames stored by reference are deleted, and only those."""

from __future__ import annotations

from pathlib import Path

import redis

from batchq.client.connection import make_client
from batchq.protocol import producer_scripts
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import PROTOCOL_VERSION
from consumer import checkpoint, start
from consumer.reader.shm_frames import TrainerShm
from consumer.session import Session
from consumer.start import DELETE_CHUNK, delete_old_frames, release, start_position


def test_old_frames_are_deleted_in_chunks_and_nothing_else(
    redis_client: redis.Redis, queue_name: str
) -> None:
    keys, other = QueueKeys(queue_name), QueueKeys(queue_name + "-other")
    names = [keys.frame("r0", "p1", i) for i in range(DELETE_CHUNK + 7)]  # two DELs
    redis_client.mset(dict.fromkeys(names, b"frame"))
    redis_client.set(other.frame("r0", "p1", 1), b"another queue's frame")
    redis_client.hset(keys.meta, "run", "r1")
    try:
        assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == len(names)
        assert redis_client.exists(*names) == 0
        assert redis_client.get(other.frame("r0", "p1", 1)) == b"another queue's frame"
        assert redis_client.hget(keys.meta, "run") == b"r1"
        assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == 0
    finally:
        redis_client.delete(other.frame("r0", "p1", 1))


def test_frames_of_the_run_read_stay_and_go_when_it_ended(
    redis_client: redis.Redis, queue_name: str
) -> None:
    # Before: a trainer's start deleted every frame of the queue, those of the run it
    # reads too; a producer let in by another group's claim had pushed some already, so
    # every group met missing_ref (CI: a striped run of two groups).
    keys = QueueKeys(queue_name)
    old, ours = keys.frame("r0", "p1", 1), keys.frame("r1", "p1", 1)
    longer = keys.frame("r10", "p1", 1)  # another run whose id starts like it
    redis_client.mset({old: b"old", ours: b"pushed already", longer: b"another"})
    assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == 2
    assert redis_client.get(ours) == b"pushed already"
    assert redis_client.exists(old, longer) == 0
    redis_client.set(old, b"old")  # left by a race of an older start: not the run's
    assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0, ended=True) == 1
    assert redis_client.get(old) == b"old" and redis_client.exists(ours) == 0


def test_a_new_runs_start_keeps_its_frames_and_its_finish_deletes_only_them(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    # The call sites: a trainer's claim starts a run, a producer pushes a frame of it
    # before the trainer's start deletes older frames (another group's claim let it: CI's
    # failure); the finish deletes that run's frames, not a newer run's.
    keys = QueueKeys(queue_name)
    client = make_client(redis_url)
    session = Session(client, keys, 10_000)
    assert session.acquire()  # a new run
    ours, old = keys.frame(session.run, "p", 1), keys.frame("0" * 16, "p", 1)
    client.mset({ours: b"pushed already", old: b"an older run's"})
    joined = producer_scripts.join(
        client, keys, producer="p", fingerprint="fp", hwm=3, shards=4, window=6,
        new_run="unused", new_incarnation="unused", heartbeat_ttl_ms=10_000,
        version=PROTOCOL_VERSION, epoch_batches=None, age_ms=0, no_create=False,
    )  # fmt: skip
    assert joined.status == "OK" and joined.run == session.run
    start_position(session, None, new_run=True, ordered=True, step=0, timeout_s=5.0)
    assert client.get(ours) == b"pushed already" and client.exists(old) == 0
    newer = keys.frame("f" * 16, "p", 1)  # a run started once this one is finished
    client.set(newer, b"a newer run's")
    shm = TrainerShm(keys, "redis", str(tmp_path))
    release(session, make_client(redis_url), shm, finished=True, timeout_s=5.0)
    assert client.exists(ours) == 0 and client.get(newer) == b"a newer run's"
    client.delete(newer)
    client.close()


def test_the_module_says_what_it_offers() -> None:
    assert start.__all__ == sorted(start.__all__)
    assert {"delete_old_frames", "open_reading"} <= set(start.__all__)
    assert {"resume_position", "Resumed"} <= set(checkpoint.__all__)
