"""Examples that kill their producer or never return, served by `batchq serve --workers 2`
against the real redis-server (issue 42).

With quarantine: 1000 examples of which 3 raise, 1 aborts its process and 1 never
returns, read by two rank processes for three epochs, both SIGKILLed in epoch 1 and
resumed from their checkpoints: every epoch is exact against its plan with the
substitutes (by bytes, against this process's build where the 5 examples raise), every
batch full, both ranks' counts equal, and the 5 examples listed with their errors.
Without quarantine: the trainer gets ProducerFailed naming the example that kills, after
max_attempts (3), instead of an endless redo (one that hangs: test_build_timeout.py).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from waiting import wait_until

torch = pytest.importorskip("torch")

from torch_pipelines import quarantine_stream  # noqa: E402

from batchq.errors import ProducerFailed  # noqa: E402
from batchq.host.procs import stop_group  # noqa: E402
from batchq.monitoring.rows import queue_status  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from producer.quarantine import MAX_DRAWS, substitute_draw  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402

EXAMPLES, BATCH = 1000, 10  # 100 batches an epoch: 50 per rank
RAISE, ABORT, HANG = (5, 77, 200), 333, 600
BAD = (*RAISE, ABORT, HANG)
EPOCHS, WORLD = 3, 2
SAVED_AT = 60  # each rank's checkpoint: batch 10 of its share of epoch 1
TRAIN = Path(__file__).resolve().parents[1] / "support" / "torch_train.py"


def digest(batch: Any) -> str:
    h = hashlib.sha256()
    for value in batch:
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def planned(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[list[int], str]]]:
    """Every batch of every epoch as this process builds it, shard by shard, where the 5
    examples raise (so are quarantined like a crash): its indices and digest."""
    monkeypatch.setenv("TEST_BAD", ",".join(map(str, BAD)))
    stream = quarantine_stream(EXAMPLES, BATCH)
    plan = ShardPlan(stream)
    return [
        [
            (np.asarray(b[0]).tolist(), digest(b))
            for s in range(plan.shards)
            for b in plan.iter_shard(e, s)
        ]
        for e in range(EPOCHS)
    ]


def substituted(stream: Any, e: int) -> list[list[int]]:
    """The DataLoader's plan of epoch e, each bad example replaced by its first drawn
    substitute that is not bad."""

    def substitute(i: int) -> int:
        for t in range(MAX_DRAWS):
            j = substitute_draw(stream.seed, e, i, t, EXAMPLES)
            if j not in BAD:
                return j
        raise AssertionError(f"no substitute for {i}")

    return [[substitute(i) if i in BAD else i for i in b] for b in stream.orders.epoch(e)]


def read_lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ranks(spawn_proc: Any, url: str, queue: str, outs: list[Path], *extra: str) -> list[Any]:
    argv = [sys.executable, str(TRAIN), "--url", url, "--queue", queue, "--epochs", str(EPOCHS)]
    return [
        spawn_proc([*argv, "--out", str(outs[r]), "--rank", str(r), "--world", str(WORLD),
                    *[a.format(r=r) for a in extra]])
        for r in range(WORLD)
    ]  # fmt: skip


@pytest.mark.timeout(120)
def test_crashes_and_hangs_are_quarantined_exactly_across_a_trainer_kill(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = serve_env(
        examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, RAISE)), abort=ABORT,
        hang=HANG,
    )  # fmt: skip
    argv = serve_argv(
        "--hwm", "4", "--workers", "2", "--heartbeat-ttl-s", "2", "--build-timeout-s", "1",
        "--on-sample-error", "quarantine", "--max-quarantined", "0.01",
        factory="torch_pipelines:broken_stream",
    )  # fmt: skip
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    first = [tmp_path / f"a{r}.jsonl" for r in range(WORLD)]
    states = tmp_path / "s{r}.json"
    procs = ranks(
        spawn_proc, redis_url, queue_name, first, "--state-out", str(states), "--state-at",
        str(SAVED_AT),
    )  # fmt: skip
    # A job crash in epoch 1: both ranks SIGKILLed once past their checkpoint.
    wait_until(
        lambda: all(o.exists() and o.read_text().count("\n") > SAVED_AT for o in first),
        timeout_s=60,
        what="both ranks past their checkpoint",
    )
    for proc in procs:
        stop_group(proc, timeout_s=5.0, sig=signal.SIGKILL)
    second = [tmp_path / f"b{r}.jsonl" for r in range(WORLD)]
    for proc in ranks(spawn_proc, redis_url, queue_name, second, "--state-in", str(states)):
        assert proc.wait(timeout=60) == 0

    want = planned(monkeypatch)
    local = quarantine_stream(EXAMPLES, BATCH)
    got = []
    for r in range(WORLD):
        *resumed, _ = read_lines(second[r])  # the last line: the stream's figures
        got.append(read_lines(first[r])[:SAVED_AT] + resumed)
    for e in range(EPOCHS):
        shares = [[(i, d) for ep, i, d in g if ep == e] for g in got]
        assert [len(s) for s in shares] == [50, 50]  # equal counts per rank
        assert shares[0] == want[e][0::2] and shares[1] == want[e][1::2]  # slot s: rank s % 2
        indices = [i for i, _ in want[e]]
        assert indices == substituted(local, e)  # the plan, substitutes where bad
        assert all(len(b) == BATCH for b in indices)  # every batch full
        assert not set(BAD) & {i for b in indices for i in b}

    cli = [sys.executable, "-m", "batchq.cli", "dead", "--url", redis_url, "--queue", queue_name]
    listed = json.loads(subprocess.run([*cli, "--json"], check=True, capture_output=True).stdout)
    records = {r["index"]: r for r in listed["examples"]}
    assert sorted(records) == sorted(BAD) and listed["count"] == len(BAD)
    for i in RAISE:
        assert records[i]["error_type"] == "ValueError"
        assert records[i]["message"] == f"example {i}: truncated record"
    assert records[ABORT]["error_type"] == "ExampleKilled"
    assert records[ABORT]["message"] == f"the producer died (SIGABRT) building example {ABORT}"
    assert records[HANG]["error_type"] == "ExampleKilled"
    assert records[HANG]["message"].startswith(
        f"example {HANG} never returned: no result after build_timeout_s=1.0"
    )
    assert all(r["substitute"] not in BAD for r in records.values())
    row = queue_status(redis_client, queue_name)
    assert row["quarantined_run"] == len(BAD)  # the resumed run's, every example met again


@pytest.mark.timeout(60)
def test_without_quarantine_an_aborting_example_is_producer_failed_after_max_attempts(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    # (A hang without quarantine: tests/producer/test_build_timeout.py.)
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, abort=ABORT)
    argv = serve_argv(
        "--hwm", "4", "--workers", "2", "--heartbeat-ttl-s", "2", "--build-timeout-s", "1",
        factory="torch_pipelines:broken_stream",
    )  # fmt: skip
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with ServerDataStream(("index", "aug"), url=redis_url, queue=queue_name) as stream:
                for _ in stream.get_epoch_iterator():
                    pass
        except BaseException as e:  # the test's thread looks at it
            errors.append(e)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    trainer.join(timeout=50)
    assert not trainer.is_alive()
    (error,) = errors
    assert isinstance(error, ProducerFailed)
    assert f"ExampleKilled: the producer died (SIGABRT) building example {ABORT}" in str(error)
