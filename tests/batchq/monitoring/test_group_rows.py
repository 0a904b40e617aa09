"""Status of a run read by several groups: a row object per group (its claim, whether it
reads the shared stream or alone, its lag and solo builds), the table's line per group,
and the exporter's families labelled ``group``."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchq.client.connection import make_client
from batchq.monitoring.exporter import BatchqCollector
from batchq.monitoring.reader_rows import GROUP_FIELDS
from batchq.monitoring.rows import queue_status
from batchq.monitoring.text import render_table
from tests.batchq.protocol.test_group_scripts import Run


def sweep(client: redis.Redis, queue: str) -> Run:
    """Three groups; c behind the others, with max_lag_batches 2, and 5 built for it alone."""
    run = Run(client, queue)
    for g in ("a", "b"):
        run.claim(g)
    run.claim("c", max_lag=2)
    run.join("p")
    for g, (cursor, floor) in {"a": (9, 7), "b": (9, 6), "c": (3, 1)}.items():
        slot = run.slots[g]
        sfx = "" if slot == 0 else f"@{slot}"
        client.hset(run.k.meta, mapping={f"next{sfx}": cursor, f"floor{sfx}": floor})
    client.hset(run.k.slot_view(2).stats, mapping={"solo_pushed": 5, "popped": 4})
    client.rpush(run.k.slot_view(2).data, b"x", b"y")
    return run


def test_a_status_row_has_one_object_per_group(redis_client: redis.Redis, queue_name: str) -> None:
    sweep(redis_client, queue_name)
    row = queue_status(redis_client, queue_name)
    groups = {g["group"]: g for g in row["groups"]}
    assert list(groups) == ["a", "b", "c"]
    assert all(tuple(g) == GROUP_FIELDS for g in row["groups"])
    c = groups["c"]
    assert (c["slot"], c["trainer"], c["sharing"]) == (2, "attached", "alone")
    assert (c["lag_batches"], c["max_lag_batches"], c["solo_builds"]) == (6.0, 2, 5)
    assert (c["depth"], c["popped"]) == (2, 4)
    assert groups["a"]["sharing"] == "shared" and groups["a"]["lag_batches"] == 0.0
    assert groups["b"]["lag_batches"] == 1.0
    assert "group c" in render_table([row]) and "built for it alone (5 so far)" in render_table(
        [row]
    )


def test_the_exporter_labels_each_group(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    sweep(redis_client, queue_name)
    registry = CollectorRegistry(auto_describe=False)
    client = make_client(redis_url)
    registry.register(BatchqCollector(client, [queue_name]))
    text = generate_latest(registry).decode()
    client.close()
    samples = {
        (s.name, s.labels.get("group")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("batchq_group_")
    }
    assert samples[("batchq_group_detached", "c")] == 1
    assert samples[("batchq_group_detached", "a")] == 0
    assert samples[("batchq_group_lag_batches", "c")] == 6
    assert samples[("batchq_group_solo_builds_total", "c")] == 5
    assert samples[("batchq_group_depth_items", "c")] == 2
