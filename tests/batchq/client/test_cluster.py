"""A client bound to the master that holds its queue's slot, on a real 3-master cluster:
it follows a slot that moves (MOVED, ASK, TRYAGAIN, NOSCRIPT on the new node), asks the
queue's own node for per-node facts, and tools find queues on every master."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest

from batchq.client.cluster import describe, key_slot, masters
from batchq.client.connection import make_client
from batchq.client.redirects import NodeClient
from batchq.errors import RedisConfigError
from batchq.monitoring.rows import list_queues, status_rows
from batchq.protocol import recovery_scripts
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys
from batchq.protocol.reaper import connected_ids

ECHO = "return {KEYS[1], redis.call('INCR', KEYS[1]), redis.call('EXISTS', KEYS[2])}"


@pytest.fixture
def bound(redis_cluster: Any, queue_name: str) -> Iterator[tuple[NodeClient, QueueKeys]]:
    keys = QueueKeys(queue_name)
    client = make_client(redis_cluster.url, key=keys.meta)
    assert isinstance(client, NodeClient)
    yield client, keys
    client.delete(*[k for k in client.scan_iter(match=keys.pattern)] or ["-"])
    client.close()


def test_the_client_talks_to_the_master_that_owns_the_queue(
    bound: tuple[NodeClient, QueueKeys], redis_cluster: Any
) -> None:
    client, keys = bound
    owner = redis_cluster.node_of(keys.meta)
    assert describe(client) == f"127.0.0.1:{redis_cluster.ports[owner]}"
    client.hset(keys.meta, "x", 1)
    assert redis_cluster.keys_per_node(keys.pattern) == [
        1 if i == owner else 0 for i in range(3)
    ]  # fmt: skip
    # Per-node facts (CLIENT LIST, for fast death detection) come from that node.
    own_id = int(client.execute_command("CLIENT", "ID"))
    assert own_id in (connected_ids(client) or set())
    with redis_cluster.clients() as nodes:
        assert own_id in {int(c["id"]) for c in nodes[owner].client_list()}


def test_a_slot_moved_mid_run_is_followed_by_scripts_and_plain_commands(
    bound: tuple[NodeClient, QueueKeys], redis_cluster: Any
) -> None:
    client, keys = bound
    slot = key_slot(keys.meta)
    counter, other = f"{keys.base}:n", f"{keys.base}:absent"
    for i in range(30):  # keys to migrate: the slot moves in steps
        client.set(f"{keys.base}:k{i}", i)

    def call() -> list[Any]:
        reply = round_trip(client, [("EVAL", ECHO, 2, counter, other)], "echo")[0]
        return list(reply)

    assert call()[1] == 1
    source = redis_cluster.node_of_slot(slot)
    target = (source + 1) % 3
    during: list[Any] = []
    late: list[list[Any]] = []
    racer = threading.Thread(target=lambda: late.append(call()))

    def between() -> None:
        # Some keys moved, the slot MIGRATING/IMPORTING: a moved key's command is asked
        # of the target (ASK); the script on keys of both sides (one never exists) gets
        # TRYAGAIN until the slot has moved, and then runs, once.
        during.append(client.get(f"{keys.base}:k0"))
        during.append(round_trip(client, [("GET", f"{keys.base}:k1")], "get")[0])
        racer.start()

    moved = redis_cluster.migrate_slot(slot, target, between=between)
    racer.join(timeout=30)
    assert moved >= 31 and redis_cluster.node_of_slot(slot) == target
    assert during == [b"0", b"1"]
    assert late and late[0][1] == 2
    # After: MOVED, the route follows; batchq's scripts were never loaded on the new node
    # (NOSCRIPT: loaded there, sent again).
    assert recovery_scripts.reap(
        client, keys, incarnation="i", why="dead", producers=["p"]
    ).status == ("STATE_LOST")
    assert call()[1] == 3
    assert describe(client) == f"127.0.0.1:{redis_cluster.ports[target]}"
    assert client.get(f"{keys.base}:k7") == b"7" and int(client.get(counter) or 0) == 3


def test_tools_find_queues_on_every_master_and_read_each_on_its_node(
    redis_cluster: Any,
) -> None:
    names = [f"t{uuid4().hex[:12]}" for _ in range(12)]
    where = {redis_cluster.node_of(QueueKeys(n).meta) for n in names}
    assert len(where) > 1  # many queues spread over the masters by their names
    client = make_client(redis_cluster.url)
    try:
        assert len(list(masters(client))) == 3
        for name in names:
            one = make_client(redis_cluster.url, key=QueueKeys(name).meta)
            one.hset(QueueKeys(name).meta, "run", "r1")
            one.close()
        assert set(names) <= set(list_queues(client))
        rows = status_rows(client, names)
        assert [r["queue"] for r in rows] == names
        for name, row in zip(names, rows, strict=True):
            owner = redis_cluster.node_of(QueueKeys(name).meta)
            assert row["node"] == f"127.0.0.1:{redis_cluster.ports[owner]}"
            assert row["run"] == "r1" and row["stripes"] == []
    finally:
        for name in names:
            one = make_client(redis_cluster.url, key=QueueKeys(name).meta)
            one.delete(QueueKeys(name).meta)
            one.close()
        client.close()


def test_clients_of_one_slot_in_threads_follow_it_together(
    bound: tuple[NodeClient, QueueKeys], redis_cluster: Any
) -> None:
    client, keys = bound
    slot = key_slot(keys.meta)
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        try:
            while not stop.is_set():
                client.incr(f"{keys.base}:hits")
        except BaseException as e:  # handed to the test
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        redis_cluster.migrate_slot(slot, (redis_cluster.node_of_slot(slot) + 2) % 3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not errors
    assert int(client.get(f"{keys.base}:hits") or 0) > 0


def test_a_cluster_url_at_a_plain_server_is_a_config_error(redis_url: str) -> None:
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    client = make_client(f"redis+cluster://127.0.0.1:{port}/")
    try:
        with pytest.raises(RedisConfigError) as info:
            list_queues(client)
    finally:
        client.close()
    assert str(info.value).startswith(f"Redis at 127.0.0.1:{port} is not a cluster node (")
    assert "use redis:// for a single server" in str(info.value)
