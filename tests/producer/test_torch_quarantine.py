"""``on_sample_error='quarantine'`` served by producer processes against the real
redis-server (issue 42): a dataset whose examples 5, 77 and 200 raise, read by two ranks
for three epochs.

Every batch is compared by its bytes with the batch this process builds by the same shard
plan (substitutes included), and its indices with the DataLoader's plan where each bad
example is replaced by the first of its drawn substitutes that is not bad.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
import redis

torch = pytest.importorskip("torch")

from built_bytes import Batch, as_bytes, built  # noqa: E402
from torch_pipelines import quarantine_stream  # noqa: E402

from batchq.errors import ProducerFailed  # noqa: E402
from batchq.monitoring.rows import queue_status  # noqa: E402
from batchq.protocol.keys import QueueKeys  # noqa: E402
from batchq.protocol.layout import parse_quarantine_record  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from producer.quarantine import MAX_DRAWS, substitute_draw  # noqa: E402

EXAMPLES, BATCH = 300, 10  # 30 batches an epoch: 15 per rank
BAD = (5, 77, 200)
EPOCHS = 3


def planned_indices(stream: Any, epochs: int) -> list[list[list[int]]]:
    """The DataLoader's plan with every bad example replaced by its substitute: the
    first draw that is not bad (and not itself)."""

    def substitute(e: int, i: int) -> int:
        for t in range(MAX_DRAWS):
            j = substitute_draw(stream.seed, e, i, t, EXAMPLES)
            if j not in BAD:
                return j
        raise AssertionError(f"no substitute for {i}")

    return [
        [[substitute(e, i) if i in BAD else i for i in batch] for batch in stream.orders.epoch(e)]
        for e in range(epochs)
    ]


def read_ranks(url: str, queue: str, epochs: int) -> dict[int, list[list[Batch]]]:
    """Two ranks in threads, each reading ``epochs`` epochs, then finishing."""
    shares: dict[int, list[list[Batch]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with ServerDataStream(
                ("index", "aug"), False, url=url, queue=queue, timeout_s=60, rank=r,
                world_size=2,
            ) as s:  # fmt: skip
                shares[r] = [[as_bytes(b) for b in s.get_epoch_iterator()] for _ in range(epochs)]
                assert s.stats["quarantined"] == len(BAD)
                s.close(finished=True)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return shares


def test_two_ranks_read_exact_epochs_with_substitutes_and_the_bad_examples_listed(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)))
    # Two workers forked by one `batchq serve`, quarantine set by its flags.
    argv = serve_argv("--hwm", "4", "--workers", "2", factory="torch_pipelines:broken_stream")
    spawn_proc([*argv, "--on-sample-error", "quarantine", "--max-quarantined", "0.01"], env=env)
    shares = read_ranks(redis_url, queue_name, EPOCHS)
    monkeypatch.setenv("TEST_BAD", env["TEST_BAD"])  # what every producer builds, here
    local = quarantine_stream(EXAMPLES, BATCH)
    want = built(local, EPOCHS)
    plan = planned_indices(local, EPOCHS)
    for e in range(EPOCHS):
        a, b = shares[0][e], shares[1][e]
        assert len(a) == len(b) == 15  # equal counts per rank
        assert a == want[e][0::2] and b == want[e][1::2]  # slot s: rank s % 2
        got = [np.frombuffer(x[0], np.int64).tolist() for x in want[e]]
        assert got == plan[e]  # the plan, every batch full, substitutes where bad
        assert all(len(batch) == BATCH for batch in got)
        assert not set(BAD) & {i for batch in got for i in batch}
    keys = QueueKeys(queue_name)
    fields = redis_client.hgetall(keys.quarantine)
    records = {
        r["index"]: r
        for r in (parse_quarantine_record(v) for k, v in fields.items() if k[:2] == b"i:")
    }
    assert sorted(records) == sorted(BAD)
    for i, r in records.items():
        assert r["error_type"] == "ValueError" and r["message"] == f"example {i}: truncated record"
        assert "raise ValueError" in r["traceback"] and r["substitute"] not in BAD
    assert int(fields[b"count"]) == len(BAD)
    assert int(redis_client.hget(keys.stats, "quarantined") or 0) == len(BAD)
    assert queue_status(redis_client, queue_name)["quarantined"] == len(BAD)  # status row
    # `batchq dead` lists them, as a table and as JSON.
    cli = [sys.executable, "-m", "batchq.cli", "dead", "--url", redis_url, "--queue", queue_name]
    listed = json.loads(subprocess.run([*cli, "--json"], check=True, capture_output=True).stdout)
    assert listed["count"] == len(BAD)
    assert listed["examples"] == sorted(records.values(), key=lambda r: (r["epoch"], r["index"]))
    table = subprocess.run(cli, check=True, capture_output=True, text=True).stdout
    for i in BAD:
        assert f"example {i}: truncated record" in table


def test_more_bad_examples_than_max_quarantined_is_producer_failed_naming_them(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # 0.005 of 300 examples: one may be quarantined, the second fails the build.
    env = serve_env(
        examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)), max_quarantined=5
    )
    spawn_proc(serve_argv("--hwm", "4", factory="torch_pipelines:quarantine_stream"), env=env)
    with (
        ServerDataStream(
            ("index", "aug"), False, url=redis_url, queue=queue_name, timeout_s=60
        ) as stream,
        pytest.raises(ProducerFailed) as caught,
    ):
        for _ in range(EPOCHS):
            for _ in stream.get_epoch_iterator():
                pass
    text = str(caught.value)
    assert "QuarantineExceeded" in text and "max_quarantined=0.005" in text
    named = [i for i in BAD if f"{i} (ValueError: example {i}: truncated record)" in text]
    assert len(named) >= 2  # the one quarantined, the one past the cap
    json.dumps(text)  # plain text, whatever the pipeline raised
