"""One pool, several jobs (issue 31): every group of a run reads every batch of every epoch,
built once, against a real redis-server with producer processes.

The pipeline logs every batch it builds (tests/support/pipelines.py, ``BuildLog``), so
the tests count builds, not pushes: what a killed producer built and never pushed is a
build too. Every batch of a shuffled epoch holds its own examples, so a batch tells its
epoch and place.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import builds, examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.protocol.keys import QueueKeys, slot_suffix
from batchq.wire.shm import DEFAULT_SHM_DIR, list_segments
from consumer import ServerDataStream

EXAMPLES, BATCH = 600, 10  # 60 batches (one shard each) per epoch
PER_EPOCH = EXAMPLES // BATCH
EPOCHS = 3
HWM = 4  # the run's cap: the producers' --hwm
PAD_BYTES = 300_000  # frames above 256 KiB: stored by reference, once for every group


def reference(epochs: int = EPOCHS) -> list[list[Any]]:
    """What every group must read: each epoch once, in plan order."""
    stream = numbered(EXAMPLES, BATCH)
    return [[e, examples_of(f)] for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def registered(client: redis.Redis, queue: str, n: int) -> bool:
    """Whether ``n`` groups have registered in the queue's run."""
    return int(client.hlen(QueueKeys(queue).groups)) >= n


def left_behind(client: redis.Redis, queue: str) -> list[str]:
    """Frames, reference counts and data lists still in Redis, and segments still in the
    shared-memory folder: what a run that ended must not leave."""
    keys = QueueKeys(queue)
    found = [k.decode() for k in client.scan_iter(match=keys.pattern, count=1000)]
    kept = [k for k in found if ":frame:" in k or ":data" in k or k == keys.refs]
    return kept + [name for name, _ in list_segments(DEFAULT_SHM_DIR, queue)]


def count_builds(log: Path, expected: list[list[Any]]) -> tuple[int, int]:
    """(builds of the batches of ``expected``, builds of anything else: the look-ahead
    past the last epoch read); every expected batch was built at least once."""
    batches = [tuple(b) for _, b in expected]
    assert len(set(batches)) == len(batches)  # each batch tells its epoch and place
    counts = Counter(builds(str(log)))
    assert all(counts[b] >= 1 for b in batches)
    wanted = sum(counts[b] for b in set(batches))
    return wanted, sum(counts.values()) - wanted


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["redis", "auto"])
def test_three_groups_read_exact_epochs_built_once_through_a_producer_kill(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    transport: str,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(
        examples=EXAMPLES, batch_size=BATCH, slow_ms=3, pad_bytes=PAD_BYTES, build_log=log
    )
    env["BATCHQ_TRANSPORT"] = transport  # both sides read it
    groups = ("g0", "g1", "g2")
    outs = {g: tmp_path / f"{g}.jsonl" for g in groups}
    figures = {g: tmp_path / f"{g}.stats.json" for g in groups}

    def trainer(g: str) -> Any:
        extra = ("--group", g, "--finish", "--stats-out", str(figures[g]))
        return spawn_proc(train_argv(redis_url, queue_name, outs[g], EPOCHS, *extra), env=env)

    trainers = {g: trainer(g) for g in groups}
    wait_until(lambda: registered(redis_client, queue_name, 3), timeout_s=60, what="3 groups")
    serve = serve_argv("--hwm", str(HWM), "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    wait_until(
        lambda: min(len(lines(outs[g])) for g in groups) >= PER_EPOCH + 10,
        timeout_s=120,
        what="every group in epoch 1",
    )
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases
    producers[0].wait(timeout=10)
    for g, proc in trainers.items():
        assert proc.wait(timeout=240) == 0, g
    assert producers[1].wait(timeout=30) == 0  # the run ended: it exits 0

    expected = reference()
    for g in groups:
        assert [list(x) for x in lines(outs[g])] == expected, g
        shm_frames = json.loads(figures[g].read_text())["shm_frames"]
        # Through shared memory, every group maps the segments (a frame that found no
        # free one goes through Redis); through Redis, none.
        assert shm_frames > len(expected) // 2 if transport == "auto" else shm_frames == 0
    stats = redis_client.hgetall(QueueKeys(queue_name).stats)
    redone = int(stats.get(b"redone_shards", 0))  # what the kill forced to be built again
    wanted, _ahead = count_builds(log, expected)
    # Built once for the three groups: the epochs' batches, plus what the kill forced.
    assert len(expected) <= wanted <= len(expected) + redone
    assert wanted < 2 * len(expected)
    assert left_behind(redis_client, queue_name) == []


# -- groups in threads of this process (to pause one), producers in processes -----------

TRAINER_HWM = 4  # each in-process group's look-ahead (frames held ahead of its loop)


class GroupTrainer(threading.Thread):
    """One group's training loop in a thread: reads ``epochs`` epochs, records what it
    got, may pause after ``pause_at`` batches until :attr:`go` is set, and finishes."""

    def __init__(
        self, url: str, queue: str, group: str, *, pause_at: int = 0, **options: Any
    ) -> None:
        super().__init__(name=f"group-{group}", daemon=True)
        self.stream = ServerDataStream(
            ("features", "targets"), url=url, queue=queue, group=group, hwm=TRAINER_HWM,
            timeout_s=60, stall_s=1.0, claim_ttl_s=2.0, **options,
        )  # fmt: skip
        self.got: list[list[Any]] = []
        self.pause_at = pause_at
        self.paused = threading.Event()
        self.go = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.stream.epoch + 1 < EPOCHS:
                for features, _ in self.stream.get_epoch_iterator():
                    self.got.append([self.stream.epoch, examples_of(features)])
                    if len(self.got) == self.pause_at:
                        self.paused.set()
                        self.go.wait(timeout=120)
            self.stream.close(finished=True)
        except BaseException as e:  # re-raised by the test
            self.error = e
            self.stream.close()

    def finish(self, timeout_s: float = 120) -> list[list[Any]]:
        """Wait for the loop to end; what it read (its error is raised)."""
        self.join(timeout=timeout_s)
        assert not self.is_alive(), f"{self.name} did not finish"
        if self.error is not None:
            raise self.error
        return self.got


def group_stats(client: redis.Redis, queue: str, group: str) -> dict[bytes, bytes]:
    """A group's counters (its slot's stats hash)."""
    keys = QueueKeys(queue)
    slot = int(client.hget(keys.groups, group) or 0)
    return client.hgetall(keys.slot_view(slot).stats)  # type: ignore[no-any-return]


def claim_lapsed(client: redis.Redis, queue: str, group: str) -> bool:
    """Whether a group's claim has passed its deadline (by the server's clock)."""
    keys = QueueKeys(queue)
    slot = int(client.hget(keys.groups, group) or 0)
    sec, usec = client.time()
    deadline = int(client.hget(keys.meta, "claim_deadline" + slot_suffix(slot)) or 0)
    return deadline < sec * 1000 + usec // 1000


def group_list(client: redis.Redis, queue: str, group: str) -> str:
    """A group's data list (its slot's)."""
    keys = QueueKeys(queue)
    return keys.slot_view(int(client.hget(keys.groups, group) or 0)).data


def start_groups(
    redis_url: str, redis_client: redis.Redis, queue_name: str, trainers: list[GroupTrainer]
) -> None:
    """Start the trainers and wait until every group has registered in the run."""
    for t in trainers:
        t.start()
    wait_until(
        lambda: registered(redis_client, queue_name, len(trainers)),
        timeout_s=60,
        what="the groups to register",
    )


@pytest.mark.timeout(240)
def test_a_paused_group_with_max_lag_does_not_hold_the_others_and_reads_exact_epochs(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1, build_log=log)
    a = GroupTrainer(redis_url, queue_name, "a")
    b = GroupTrainer(redis_url, queue_name, "b")
    # p may lag 2 batches: its full list never holds the others, its window (8 shards)
    # only while it is within 2 batches of the leading group.
    paused = GroupTrainer(redis_url, queue_name, "p", pause_at=15, max_lag_batches=2)
    start_groups(redis_url, redis_client, queue_name, [a, b, paused])
    serve = serve_argv("--hwm", str(HWM))
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    expected = reference()
    # While p stays paused, the others read every epoch to the end.
    assert paused.paused.wait(timeout=120)
    assert a.finish() == expected and b.finish() == expected
    assert len(paused.got) == 15 and paused.is_alive()
    paused.go.set()
    assert paused.finish() == expected
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    # p's batches after it fell behind were built for it alone, counted in its stats;
    # what a and b read was built once for both.
    p_stats = group_stats(redis_client, queue_name, "p")
    solo = int(p_stats.get(b"solo_pushed", 0))
    assert solo > 0
    wanted, _ahead = count_builds(log, expected)
    # A build for p alone that found its list full again (a race of two producers for
    # its one free place) goes back for it once more: a drop.
    assert wanted <= len(expected) + solo + int(p_stats.get(b"detached_drops", 0))
    assert left_behind(redis_client, queue_name) == []


@pytest.mark.timeout(240)
def test_without_max_lag_the_others_wait_for_a_paused_group(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1, build_log=log)
    a = GroupTrainer(redis_url, queue_name, "a")
    paused = GroupTrainer(redis_url, queue_name, "p", pause_at=15)
    start_groups(redis_url, redis_client, queue_name, [a, paused])
    producers = [spawn_proc(serve_argv("--hwm", str(HWM)), env=env) for _ in range(2)]
    assert paused.paused.wait(timeout=120)
    # Every push goes into both lists at once while p paces the run: once p's list is
    # full nothing more is pushed, and a reads what was delivered to both, then waits.
    lists = {g: group_list(redis_client, queue_name, g) for g in ("a", "p")}
    wait_until(
        lambda: (
            redis_client.llen(lists["p"]) == HWM
            and redis_client.llen(lists["a"]) == 0
            and len(a.got) >= 15
            and a.stream.frame_ready() is False
        ),
        timeout_s=120,
        what="p's list to fill and a to wait",
    )
    held, _floor = paused.stream._buffer.fill()  # frames p's reader holds past its 15
    assert len(a.got) <= 15 + held + HWM  # no frame that p was not given too
    paused.go.set()
    expected = reference()
    assert a.finish() == expected and paused.finish() == expected
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    # Each batch was built once, for both.
    wanted, _ahead = count_builds(log, expected)
    assert wanted == len(expected)


@pytest.mark.timeout(240)
def test_a_group_started_at_epoch_2_of_the_others_reads_exact_epochs(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1)
    a = GroupTrainer(redis_url, queue_name, "a")
    b = GroupTrainer(redis_url, queue_name, "b")
    start_groups(redis_url, redis_client, queue_name, [a, b])
    producers = [spawn_proc(serve_argv("--hwm", str(HWM)), env=env) for _ in range(2)]
    wait_until(lambda: len(a.got) >= 2 * PER_EPOCH, timeout_s=120, what="a in epoch 2")
    late = GroupTrainer(redis_url, queue_name, "late")
    late.start()
    expected = reference()
    assert a.finish() == expected and b.finish() == expected
    assert late.finish() == expected
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    # What the others had read when it came was built again for it alone.
    assert int(group_stats(redis_client, queue_name, "late").get(b"solo_pushed", 0)) > 0
    assert left_behind(redis_client, queue_name) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("restart", ["checkpoint", "no_state"])
def test_a_group_killed_and_restarted_reads_exact_epochs(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    restart: str,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
    outs = {g: tmp_path / f"{g}.jsonl" for g in ("a", "b", "c1", "c2")}
    state = tmp_path / "c.state.json"

    def trainer(group: str, out: Path, *extra: str) -> Any:
        argv = train_argv(redis_url, queue_name, out, EPOCHS, "--group", group, "--finish")
        return spawn_proc([*argv, *extra], env=env)

    others = [trainer("a", outs["a"]), trainer("b", outs["b"])]
    first = trainer("c", outs["c1"], "--state-out", str(state))
    wait_until(lambda: registered(redis_client, queue_name, 3), timeout_s=60, what="3 groups")
    producers = [spawn_proc(serve_argv("--hwm", str(HWM)), env=env) for _ in range(2)]
    wait_until(lambda: len(lines(outs["c1"])) >= 70, timeout_s=120, what="c in epoch 1")
    os.killpg(first.pid, signal.SIGKILL)  # its claim lapses; without max_lag a and b wait
    first.wait(timeout=10)
    saved = json.loads(state.read_text())
    at = saved["epoch"] * PER_EPOCH + sum(saved["consumed"].values())
    if restart == "checkpoint":  # exactly where it was: the others read on meanwhile
        second = trainer("c", outs["c2"], "--state-in", str(state))
    else:  # from epoch 0 again, as a group that joins late, once its claim lapsed
        wait_until(lambda: claim_lapsed(redis_client, queue_name, "c"), what="c's claim to lapse")
        second = trainer("c", outs["c2"])
    expected = reference()
    for proc in (*others, second):
        assert proc.wait(timeout=240) == 0
    for proc in producers:
        assert proc.wait(timeout=30) == 0
    for g in ("a", "b"):
        assert [list(x) for x in lines(outs[g])] == expected, g
    again = [list(x) for x in lines(outs["c2"])]
    if restart == "checkpoint":
        assert [list(x) for x in lines(outs["c1"])][:at] + again == expected
    else:
        assert again == expected
    assert left_behind(redis_client, queue_name) == []
