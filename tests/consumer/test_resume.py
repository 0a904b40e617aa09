"""Resume exactly: checkpoints, killed trainers, Redis restarts, paused trainers."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.errors import ConfigError, TrainerConflict
from batchq.host.embedded import EmbeddedRedis
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

EXAMPLES, BATCH = 200, 10  # 20 batches (shards) per epoch


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def position(state: dict[str, Any]) -> int:
    """Batches consumed before a state (ordered: a prefix of each epoch)."""
    return state["epoch"] * (EXAMPLES // BATCH) + sum(state["consumed"].values())


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    def start(n: int, url: str | None = None, *extra: str) -> list[Any]:
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2", *extra)
        if url is not None:
            argv[argv.index("--url") + 1] = url
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1)
        return [spawn_proc(argv, env=env) for _ in range(n)]

    return start


@pytest.mark.parametrize("point", [0, 7, 19])
@pytest.mark.parametrize("ordered", [True, False])
def test_checkpoint_in_epoch_2_resumes_exactly_in_a_fresh_process(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    point: int,
    ordered: bool,
) -> None:
    producers(2)
    first: list[tuple[int, list[int]]] = []
    stream = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, ordered=ordered
    )
    for _ in range(2):
        first += [(stream.epoch, examples_of(f)) for f, _ in stream.get_epoch_iterator()]
    it = stream.get_epoch_iterator()
    first += [(2, examples_of(next(it)[0])) for _ in range(point)]
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["epoch"] == 2 and sum(state["consumed"].values()) == point
    stream.close()  # an ordinary exit; the next test kills instead
    (tmp_path / "state.json").write_text(json.dumps(state))
    out = tmp_path / "out.jsonl"
    extra = ["--state-in", str(tmp_path / "state.json"), "--finish"]
    if not ordered:
        extra.append("--unordered")
    proc = spawn_proc(train_argv(redis_url, queue_name, out, 4, *extra))
    assert proc.wait(timeout=60) == 0
    expected = reference(4)
    if ordered:
        assert first + lines(out) == expected
    else:
        got = first + lines(out)
        for e in range(4):
            assert sorted(b for ep, b in got if ep == e) == sorted(
                b for ep, b in expected if ep == e
            )


@pytest.mark.parametrize("queue_url", ["redis", "cluster", "stripes"], indirect=True)
def test_sigkilled_trainer_restarts_from_its_last_state(
    queue_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    producers(3)
    out_a, out_b, state = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "s.json"
    a = spawn_proc(train_argv(queue_url, queue_name, out_a, 4, "--state-out", str(state)))
    wait_until(lambda: len(lines(out_a)) >= 33, timeout_s=60, what="the trainer in epoch 1")
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    saved = json.loads(state.read_text())
    # load_state_dict takes over at once although the killed trainer's claim is live.
    b = spawn_proc(
        train_argv(queue_url, queue_name, out_b, 4, "--state-in", str(state), "--finish")
    )
    assert b.wait(timeout=60) == 0
    assert lines(out_a)[: position(saved)] + lines(out_b) == reference(4)


def test_a_second_trainer_without_state_still_conflicts(
    redis_url: str, queue_name: str, producers: Any
) -> None:
    producers(1)
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name) as a:
        next(iter(a.get_epoch_iterator()))
        b = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
        with pytest.raises(TrainerConflict):
            b.get_epoch_iterator()
        b.close()


@pytest.mark.parametrize("kill_at", [25, 47])
def test_redis_restarting_empty_mid_epoch_completes_exactly(
    own_redis: EmbeddedRedis, queue_name: str, producers: Any, kill_at: int
) -> None:
    producers(3, own_redis.url)
    got = []
    with ServerDataStream(
        ("features", "targets"), url=own_redis.url, queue=queue_name, stall_s=1.0
    ) as stream:
        for _ in range(4):
            for f, _ in stream.get_epoch_iterator():
                got.append((stream.epoch, examples_of(f)))
                if len(got) == kill_at:
                    own_redis.kill()
                    own_redis.restart(wipe=True)
        stream.close(finished=True)
    assert got == reference(4)


def test_a_finish_after_redis_restarted_empty_still_ends_the_producers(
    own_redis: EmbeddedRedis, queue_name: str, producers: Any
) -> None:
    # The finish finds no run (claim.lua: STATE_LOST): the stream claims the queue again
    # and finishes the run the producers made since, so they exit 0 (before, the finish
    # was dropped and they served on until orphan_exit_s).
    procs = producers(2, own_redis.url)
    got = []
    with ServerDataStream(
        ("features", "targets"), url=own_redis.url, queue=queue_name, stall_s=1.0
    ) as stream:
        for f, _ in stream.get_epoch_iterator():
            got.append((stream.epoch, examples_of(f)))
        own_redis.kill()
        own_redis.restart(wipe=True)
        stream.close(finished=True)
    assert got == reference(1)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]


def test_redis_with_aof_restarting_completes_exactly(
    tmp_path: Path, queue_name: str, producers: Any
) -> None:
    server = EmbeddedRedis(workdir=str(tmp_path / "aof"), appendonly=True)
    server.start()
    try:
        producers(3, server.url)
        got = []
        with ServerDataStream(
            ("features", "targets"), url=server.url, queue=queue_name, stall_s=1.0
        ) as stream:
            for _ in range(3):
                for f, _ in stream.get_epoch_iterator():
                    got.append((stream.epoch, examples_of(f)))
                    if len(got) == 30:
                        server.stop()
                        server.restart(wipe=False)
            stream.close(finished=True)
        assert got == reference(3)
    finally:
        server.stop()


def test_paused_trainer_loses_nothing(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    redis_client: Any,
) -> None:
    keys = QueueKeys(queue_name)
    producers(2)
    out = tmp_path / "out.jsonl"
    trainer = spawn_proc(train_argv(redis_url, queue_name, out, 3, "--finish"))
    wait_until(lambda: len(lines(out)) >= 10, timeout_s=60, what="the trainer in epoch 0")
    trainer.send_signal(signal.SIGSTOP)

    def claim_lapsed() -> bool:
        sec, usec = redis_client.time()
        deadline = int(redis_client.hget(keys.meta, "claim_deadline") or 0)
        return deadline < sec * 1000 + usec // 1000

    # Paused past its claim's deadline, with the producers held at the hwm or the
    # look-ahead window meanwhile.
    wait_until(claim_lapsed, timeout_s=30, what="the claim to lapse")
    trainer.send_signal(signal.SIGCONT)
    assert trainer.wait(timeout=60) == 0
    assert lines(out) == reference(3)


def test_bad_state_is_refused_with_the_value(redis_url: str, queue_name: str) -> None:
    stream = ServerDataStream(("features",), url=redis_url, queue=queue_name)
    with pytest.raises(ConfigError, match="version"):
        stream.load_state_dict({"version": 9})
    with pytest.raises(ConfigError, match="epoch"):
        stream.load_state_dict(
            {"version": 1, "run": "r", "fingerprint": "f", "shards": 2, "epoch": "x"}
        )
    with pytest.raises(ConfigError, match="queue 'other'"):
        stream.load_state_dict({"version": 1, "queue": "other"})
    stream.close()
