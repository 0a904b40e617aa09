"""The trainer steers its producers (issue 30), against a real redis-server with producer
processes: changes at the default index, at ``at_batch`` and at ``at_epoch`` apply
exactly from the index set_params returned, batches built ahead with older params are
dropped and built again, every epoch stays exact (one producer SIGKILLed mid-epoch);
a run killed and resumed from an older checkpoint, which makes the same call at the
same step again, is byte-identical to the run that was not (also after Redis restarted
empty)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.host.embedded import EmbeddedRedis
from batchq.monitoring.rows import queue_status
from batchq.monitoring.text import render_table
from batchq.protocol.keys import QueueKeys
from batchq.protocol.params_log import thaw
from batchq.wire.codec import peek_header
from consumer import ServerDataStream

EXAMPLES, BATCH = 400, 10  # 40 batches (one per shard) an epoch: index = step
EPOCH = EXAMPLES // BATCH
HWM = 4  # the run's cap: window W = 8 shards, so D = 2 W = 16 batches


def reference(examples: int, epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(examples, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


def expected(calls: list[tuple[int, dict[str, Any]]], index: int) -> dict[str, Any]:
    """The params at ``index``: every change at or before it, in (index, call) order."""
    out: dict[str, Any] = {}
    for _, update in sorted(
        ((i, n), u) for n, (i, u) in enumerate(calls) if i <= index
    ):  # fmt: skip
        out.update(update)
    return out


@pytest.mark.timeout(180)
def test_changes_apply_exactly_where_set_params_says_with_a_producer_killed(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    keys = QueueKeys(queue_name)
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
    env["BATCHQ_TRANSPORT"] = "redis"  # frames in the list, whose headers the test reads
    argv = serve_argv("--hwm", str(HWM), "--heartbeat-ttl-s", "10", factory="pipelines:steered")
    producers = [spawn_proc(argv, env=env) for _ in range(3)]

    def built_ahead(index: int) -> bool:
        """Whether the list holds a batch at ``index`` or past it (its shard, with one
        batch per shard): built with the params before the change about to be made."""
        headers = [peek_header(e) for e in redis_client.lrange(keys.data, 0, -1)]
        return any(h["ep"] * EPOCH + h["sh"] >= index for h in headers)

    calls: list[tuple[int, dict[str, Any]]] = []
    got: list[tuple[int, list[int]]] = []
    rebuilt_before = {}
    stream = ServerDataStream(
        ("features", "targets", "params"), url=redis_url, queue=queue_name, stall_s=1.0,
        transport="redis",
    )  # fmt: skip
    step = 0
    for epoch in range(3):
        for features, _, params in stream.get_epoch_iterator():
            # The batch at index `step` was built with the params in effect there.
            assert json.loads(params) == expected(calls, step), f"batch {step}"
            assert thaw(stream.params) == json.loads(params)
            got.append((epoch, examples_of(features)))
            step += 1
            if step == 5:
                row = queue_status(redis_client, queue_name)
                assert row["lookahead_batches"] == 2 * 2 * HWM
                index = stream.set_params({"level": 1})
                assert index == step + row["lookahead_batches"]  # the default: position + D
                calls.append((index, {"level": 1}))
            elif step == 10:
                wait_until(lambda: built_ahead(12), what="batches past 12 built")
                rebuilt_before["at_batch"] = stream.stats["rebuilt_params"]
                update = {"level": 2, "tag": "x"}  # retroactive: before the change at 21
                assert stream.set_params(update, at_batch=12) == 12
                calls.append((12, update))
            elif step == 15:
                os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch
            elif step == 33:
                wait_until(lambda: built_ahead(40), what="epoch 1 built ahead")
                rebuilt_before["at_epoch"] = stream.stats["rebuilt_params"]
                assert stream.set_params({"level": 3}, at_epoch=1) == 40
                calls.append((40, {"level": 3}))
                with pytest.raises(ValueError, match="at_batch 30 is in the past"):
                    stream.set_params({"level": 4}, at_batch=30)
    state = stream.state_dict()
    stream.close(finished=True)
    assert got == reference(EXAMPLES, 3)  # every epoch exact
    assert [(e["index"], e["params"]) for e in state["params"]] == [
        (21, {"level": 1}),
        (12, {"level": 2, "tag": "x"}),
        (40, {"level": 3}),
    ]
    # The batches built ahead with older params were dropped and built again, counted.
    rebuilt = stream.stats["rebuilt_params"]
    assert rebuilt > rebuilt_before["at_epoch"] > rebuilt_before["at_batch"]
    row = queue_status(redis_client, queue_name)
    assert row["rebuilt_params"] == rebuilt and row["params_version"] == 3
    assert "look-ahead: 16 batches" in render_table([row])  # batchq status


def lines(path: Path) -> list[list[Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def trainer_argv(url: str, queue: str, out: Path, *extra: str) -> list[str]:
    script = str(Path(__file__).resolve().parents[1] / "support" / "steer_train.py")
    return [sys.executable, script, "--url", url, "--queue", queue, "--epochs", "3",
            "--out", str(out), *extra]  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("redis_restarts", [False, True])
def test_a_run_resumed_from_an_older_checkpoint_is_byte_identical(
    own_redis: EmbeddedRedis,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    redis_restarts: bool,
) -> None:
    env = serve_env(examples=200, batch_size=BATCH, slow_ms=1)

    def producers(queue: str) -> None:
        argv = serve_argv("--hwm", str(HWM), "--heartbeat-ttl-s", "5", factory="pipelines:steered")
        argv[argv.index("--url") + 1] = own_redis.url
        argv[argv.index("--queue") + 1] = queue
        for _ in range(2):
            spawn_proc(argv, env=env)

    # Run A: changes at steps 7 (at_batch=9) and 25 (the default index), 3 epochs.
    out_a = tmp_path / "a.jsonl"
    producers("runa")
    assert spawn_proc(trainer_argv(own_redis.url, "runa", out_a)).wait(timeout=120) == 0
    # Run B: the same loop, its checkpoint at step 20, SIGKILLed at step 30 (after the
    # step-25 call), resumed from the step-20 checkpoint: it makes the step-25 call again.
    out_b, out_c, state = tmp_path / "b.jsonl", tmp_path / "c.jsonl", tmp_path / "s.json"
    producers("runb")
    first = spawn_proc(
        trainer_argv(own_redis.url, "runb", out_b, "--state-out", str(state), "--state-at",
                     "20", "--hold-at", "30")
    )  # fmt: skip
    wait_until(lambda: len(lines(out_b)) >= 30, timeout_s=90, what="run B at step 30")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    if redis_restarts:
        own_redis.kill()
        own_redis.restart(wipe=True)  # the queue, the run and its params log are gone
    resumed = spawn_proc(trainer_argv(own_redis.url, "runb", out_c, "--state-in", str(state)))
    assert resumed.wait(timeout=120) == 0
    a, b, c = lines(out_a), lines(out_b), lines(out_c)
    assert len(a) == 60 and b[:30] == a[:30]
    assert c == a[20:]  # byte-identical from step 20 on
    # Line i is the batch at index i: the changes applied at 9 and at 25 + D = 41.
    assert [json.loads(a[i][3]) for i in (8, 9, 40, 41)] == [
        {}, {"level": 1}, {"level": 1}, {"level": 2, "aug": 0.5},
    ]  # fmt: skip
