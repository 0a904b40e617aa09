"""producer.transformers.cached_mapping served by real producer processes through the
real redis-server: a Fuel pipeline's cached per-example stage changes no byte, cold or
warm (the pipelines: tests/support/fuel_cache_pipelines.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
import redis
from cache_layout import entries
from fuel_cache_pipelines import uncached_stream
from waiting import wait_until

from batchq.protocol.admin import delete_queue
from consumer import ServerDataStream
from producer.serving.sharding import ShardPlan

N, EPOCHS = 24, 2
SOURCES = ("image", "label")

Batch = tuple[bytes, ...]


def built(stream: Any, epochs: int) -> list[list[Batch]]:
    plan = ShardPlan(stream)
    shards = [[plan.iter_shard(e, s) for s in range(plan.shards)] for e in range(epochs)]
    return [[_bytes(b) for shard in epoch for b in shard] for epoch in shards]


def _bytes(batch: Any) -> Batch:
    return tuple(np.asarray(v).tobytes() for v in batch)


@pytest.fixture
def queues(redis_url: str) -> Any:
    """Fresh queue names; their keys go afterwards."""
    names: list[str] = []

    def new() -> str:
        names.append(f"t{uuid4().hex[:12]}")
        return names[-1]

    yield new
    client = redis.Redis.from_url(redis_url)
    try:
        for name in names:
            delete_queue(client, name)
    finally:
        client.close()


def test_a_served_fuel_pipeline_with_its_stage_cached_changes_no_byte_cold_or_warm(
    redis_url: str, queues: Any, spawn_proc: Any, serve_argv: Any, serve_env: Any, tmp_path: Path
) -> None:
    env = serve_env(examples=N, cache_dir=tmp_path)
    runs: dict[str, list[list[Batch]]] = {}
    for name, factory in [
        ("uncached", "fuel_cache_pipelines:uncached_stream"),
        ("cold", "fuel_cache_pipelines:cached_stream"),
        ("warm", "fuel_cache_pipelines:cached_stream"),
    ]:
        queue = queues()
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "1", factory=factory)
        argv[argv.index("--queue") + 1] = queue
        procs = [spawn_proc(argv, env=env) for _ in range(2)]
        with ServerDataStream(SOURCES, False, url=redis_url, queue=queue, timeout_s=60) as stream:
            runs[name] = [[_bytes(b) for b in stream.get_epoch_iterator()] for _ in range(EPOCHS)]
            if name == "warm":  # every example read from the cache, none computed
                figures = wait_until(
                    lambda: _all_read(stream.stats["cache"]), what="the producers' cache figures"
                )
                assert figures["misses"] == 0 and figures["hit_rate"] == 1.0
            stream.close(finished=True)
        for proc in procs:
            assert proc.wait(timeout=30) == 0
    want = built(uncached_stream(N), EPOCHS)
    assert want[0] != want[1]  # the crops differ from epoch to epoch
    assert runs["uncached"] == want
    assert runs["cold"] == want and runs["warm"] == want
    assert len(entries(tmp_path)) == N


def _all_read(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    """The figures once they count every example the run read."""
    if figures is None or figures["hits"] + figures["misses"] < EPOCHS * N:
        return None
    return figures
