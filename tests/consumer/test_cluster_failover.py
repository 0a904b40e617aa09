"""A cluster master fails over under a running queue: its replica is promoted, by
``CLUSTER FAILOVER`` (coordinated) and by the cluster's own election after a SIGKILL of
the master; the producers and the trainer follow the slot (MOVED, a refused connection
and the slot map read again) and every epoch stays exact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pipelines import examples_of, numbered
from redis_cluster import LocalCluster

from batchq.client.cluster import key_slot
from batchq.client.connection import make_client
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

EXAMPLES, BATCH = 300, 10  # 30 batches per epoch


@pytest.fixture(scope="module")
def replicated() -> Iterator[LocalCluster]:
    """3 masters, a replica each, a short node timeout (a dead master is failed over in
    seconds); for this file only: its failovers change the cluster."""
    cluster = LocalCluster(3, replicas=1, node_timeout_ms=1000)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_queue(replicated: LocalCluster, queue_name: str) -> Iterator[str]:
    yield replicated.url
    client = make_client(replicated.url, key=QueueKeys(queue_name).meta)
    try:
        delete_queue(client, queue_name)
    finally:
        client.close()


def test_a_failed_over_master_keeps_every_epoch_exact(
    replicated: LocalCluster,
    cluster_queue: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3)
    argv = serve_argv("--hwm", "4")
    argv[argv.index("--url") + 1] = cluster_queue
    for _ in range(2):
        spawn_proc(argv, env=env)
    slot = key_slot(QueueKeys(queue_name).meta)
    stream = numbered(EXAMPLES, BATCH)
    expected = [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(4)]
    took = []
    with ServerDataStream(
        ("features", "targets"), url=cluster_queue, queue=queue_name, timeout_s=60, stall_s=1.0
    ) as trainer:
        for e in range(4):
            got = []
            for f, _ in trainer.get_epoch_iterator():
                got.append(examples_of(f))
                if e in (1, 2) and len(got) == 10:  # mid-epoch: the queue's master goes
                    master = replicated.node_of_slot(slot)
                    took.append(replicated.failover(master, kill=e == 2))
            assert got == expected[e]
        trainer.close(finished=True)
    print(f"\nfailovers of the queue's master: CLUSTER FAILOVER {took[0]:.2f} s, "
          f"SIGKILL {took[1]:.2f} s until every node names the new master")  # fmt: skip
