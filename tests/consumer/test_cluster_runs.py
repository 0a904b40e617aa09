"""Runs on a real 3-master cluster that only a cluster has: the queue's slot migrated to
another master mid-epoch, and a run's stripes fixed when it is created."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from pipelines import examples_of, numbered, steered
from waiting import wait_until

from batchq.cli import main
from batchq.client.cluster import key_slot
from batchq.client.connection import make_client
from batchq.errors import PipelineMismatch
from batchq.monitoring.rows import status_rows
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from producer import Producer, StripedProducer

EXAMPLES, BATCH = 300, 10  # 30 batches per epoch


def reference(epochs: int) -> list[list[list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(epochs)]


@pytest.mark.parametrize("queue_url", ["cluster"], indirect=True)
def test_the_queues_slot_migrated_mid_epoch_keeps_every_epoch_exact(
    queue_url: str,
    queue_name: str,
    redis_cluster: Any,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3)
    for _ in range(2):
        spawn_proc(serve_argv("--hwm", "4"), env=env)
    keys = QueueKeys(queue_name)
    slot = key_slot(keys.meta)
    source = redis_cluster.node_of_slot(slot)
    target = (source + 1) % 3
    expected, moved = reference(3), 0
    with ServerDataStream(
        ("features", "targets"), url=queue_url, queue=queue_name, timeout_s=30, stall_s=1.0
    ) as stream:
        for e in range(3):
            got = []
            for f, _ in stream.get_epoch_iterator():
                got.append(examples_of(f))
                if e == 1 and len(got) == 10:
                    # SETSLOT IMPORTING/MIGRATING, MIGRATE of its keys in steps, SETSLOT NODE:
                    # the producers push and the reader pops all along (ASK, TRYAGAIN, MOVED).
                    moved = redis_cluster.migrate_slot(slot, target)
            assert got == expected[e]
        assert moved > 0 and redis_cluster.node_of_slot(slot) == target
        client = make_client(queue_url)
        (row,) = status_rows(client, [queue_name])
        client.close()
        assert row["node"] == f"127.0.0.1:{redis_cluster.ports[target]}"
        stream.close(finished=True)


@pytest.mark.parametrize("queue_url", ["cluster"], indirect=True)
def test_a_runs_stripes_are_fixed_when_it_is_created(queue_url: str, queue_name: str) -> None:
    first = StripedProducer(numbered(EXAMPLES, BATCH), queue_url, queue_name, 4, stripes=3)
    serving = threading.Thread(target=first.serve, daemon=True)
    serving.start()
    client = make_client(queue_url, key=QueueKeys(queue_name).meta)
    try:
        wait_until(lambda: client.hget(QueueKeys(queue_name).meta, MetaField.STRIPES), what="run")
        assert client.hget(QueueKeys(queue_name).meta, MetaField.STRIPES) == b"3"
        for other in (
            StripedProducer(numbered(EXAMPLES, BATCH), queue_url, queue_name, 4, stripes=2),
            Producer(numbered(EXAMPLES, BATCH), queue_url, queue_name, 4),
        ):
            with pytest.raises(PipelineMismatch, match="stripes is '3', this producer has"):
                other.serve()
    finally:
        first.stop()
        serving.join(timeout=10)
        client.close()


@pytest.mark.parametrize("queue_url", ["cluster"], indirect=True)
def test_status_shows_each_stripes_node_and_reset_deletes_every_stripe(
    queue_url: str, queue_name: str, redis_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    producer = StripedProducer(numbered(EXAMPLES, BATCH), queue_url, queue_name, 4, stripes=3)
    serving = threading.Thread(target=producer.serve, daemon=True)
    serving.start()
    stripes = [QueueKeys(queue_name).stripe(k, 3) for k in range(3)]
    clients = [make_client(queue_url, key=keys.meta) for keys in stripes]
    try:  # every stripe's list at its cap: the producer served each
        wait_until(
            lambda: all(c.llen(k.data) == 4 for c, k in zip(clients, stripes, strict=True)),
            what="every stripe's list at its cap",
        )
    finally:
        producer.stop()
        serving.join(timeout=10)
        for client in clients:
            client.close()
    assert main(["status", "--url", queue_url]) == 0
    text = capsys.readouterr().out
    assert f"{queue_name}: " in text and "3 stripes" in text
    for k, keys in enumerate(stripes):
        node = redis_cluster.ports[redis_cluster.node_of(keys.meta)]
        assert f"stripe {k} {keys.queue} on 127.0.0.1:{node}: depth 4/4" in text
    assert stripes[1].queue not in text.split("\n\n")[0]  # one row: the queue's
    assert main(["reset", "--url", queue_url, "--queue", queue_name, "--yes"]) == 0
    assert redis_cluster.keys_per_node(f"bq:{{{queue_name}*}}:*") == [0, 0, 0]


@pytest.mark.parametrize("queue_url", ["stripes"], indirect=True)
def test_set_params_on_a_queue_striped_over_the_masters_applies_exactly(
    queue_url: str, queue_name: str, producer_thread: Any
) -> None:
    producer_thread(steered(EXAMPLES, BATCH))  # 3 stripes, one per master
    calls: list[tuple[int, dict[str, Any]]] = []
    with ServerDataStream(
        ("features", "targets", "params"),
        url=queue_url,
        queue=queue_name,
        stall_s=1.0,
        timeout_s=30,
    ) as stream:
        step, got = 0, []
        for _ in range(2):
            for features, _, params in stream.get_epoch_iterator():
                want: dict[str, Any] = {}
                for _, _, update in sorted(
                    (i, n, u) for n, (i, u) in enumerate(calls) if i <= step
                ):  # fmt: skip
                    want.update(update)
                assert json.loads(params) == want, f"batch {step}"
                got.append(examples_of(features))
                step += 1
                if step == 3:
                    calls.append((stream.set_params({"level": 1}), {"level": 1}))
                elif step == 6:
                    assert stream.set_params({"level": 2}, at_batch=8) == 8
                    calls.append((8, {"level": 2}))
        assert [got[:30], got[30:]] == reference(2)
        assert calls[0][0] == 3 + 2 * 3 * 2 * 4  # D: 3 stripes x W = 8 shards, twice
        stream.close(finished=True)


@pytest.mark.parametrize("queue_url", ["stripes"], indirect=True)
def test_two_groups_read_a_queue_striped_over_the_masters_exactly(
    queue_url: str, queue_name: str, producer_thread: Any
) -> None:
    streams = [
        ServerDataStream(
            ("features", "targets"), url=queue_url, queue=queue_name, group=g, timeout_s=30
        )
        for g in ("g0", "g1")
    ]
    producer_thread(numbered(EXAMPLES, BATCH))
    try:
        for epoch in reference(2):
            its = [s.get_epoch_iterator() for s in streams]
            pairs = list(zip(*its, strict=True))  # the groups read in step
            for k in range(2):
                assert [examples_of(pair[k][0]) for pair in pairs] == epoch
        for s in streams:
            s.close(finished=True)
    finally:
        for s in streams:
            s.close()
