"""producer.torch.cached served by real producer processes through the real redis-server.

The pipelines are tests/support/cache_pipelines.py's: the same computation with the
cache (``cached(stage, augment=jitter_image)``) and without (one dataset applying the
stage, then jitter). Every batch is compared by its bytes with what the uncached
pipeline builds (tests/producer/test_torch_served.py holds served == built for it).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
import redis
from waiting import wait_until

torch = pytest.importorskip("torch")

from cache_layout import disk_bytes, entries, entry_bytes, files  # noqa: E402
from cache_pipelines import stage, uncached_stream  # noqa: E402

from batchq.monitoring.rows import queue_status  # noqa: E402
from batchq.protocol.admin import delete_queue  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from producer.cache_entry import decode_entry, encode_entry  # noqa: E402
from producer.cache_segment import index_ends, parse_segment_name  # noqa: E402
from producer.cache_store import ENTRY_OVERHEAD  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch.cache import _TENSORS, stage_fingerprint  # noqa: E402

N, EPOCHS = 32, 3
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


def _argv(serve_argv: Any, queue: str, factory: str) -> list[str]:
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "1", factory=factory)
    argv[argv.index("--queue") + 1] = queue
    return argv


def test_serving_cached_changes_no_byte_cold_or_warm_and_the_figures_show_it(
    redis_url: str,
    redis_client: Any,
    queues: Any,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=N, cache_dir=tmp_path)
    runs: dict[str, list[list[Batch]]] = {}
    for name, factory in [
        ("uncached", "cache_pipelines:uncached_stream"),
        ("cold", "cache_pipelines:cached_stream"),
        ("warm", "cache_pipelines:cached_stream"),
    ]:
        queue = queues()
        procs = [spawn_proc(_argv(serve_argv, queue, factory), env=env) for _ in range(2)]
        with ServerDataStream(SOURCES, False, url=redis_url, queue=queue, timeout_s=60) as stream:
            runs[name] = [[_bytes(b) for b in stream.get_epoch_iterator()] for _ in range(EPOCHS)]
            if name == "warm":  # every example read from the cache, none built
                figures = wait_until(
                    lambda: _all_read(stream.stats["cache"]), what="the producers' cache figures"
                )
                assert figures["misses"] == 0 and figures["hit_rate"] == 1.0
                assert figures["bytes"] == disk_bytes(tmp_path)
                row = queue_status(redis_client, queue)
                assert row["cache_hit_rate"] == 1.0 and row["cache_bytes"] == figures["bytes"]
                assert all(p["cache_hits"] > 0 for p in row["producers"])
            stream.close(finished=True)
        for proc in procs:
            assert proc.wait(timeout=30) == 0
    want = built(uncached_stream(N), EPOCHS)
    assert runs["uncached"] == want
    assert runs["cold"] == want and runs["warm"] == want
    assert want[0] != want[1]  # the augmentation differs from epoch to epoch
    assert len(entries(tmp_path)) == N


def _all_read(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    """The figures once they count every example the run read (and the probes)."""
    if figures is None or figures["hits"] + figures["misses"] < EPOCHS * N:
        return None
    return figures


def test_a_producer_killed_while_writing_leaves_nothing_torn_and_the_cap_holds(
    redis_url: str,
    queues: Any,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 24
    # Large entries (about 1 MB: the writes take a while), a cap of half the data.
    monkeypatch.setenv("TEST_BLOCK_BYTES", str(2**20))  # for stage() here too
    fingerprint = stage_fingerprint(stage(n))
    cap = (len(encode_entry(stage(n)[0], fingerprint, 0, _TENSORS)) + ENTRY_OVERHEAD) * n // 2
    env = serve_env(examples=n, cache_dir=tmp_path / "c", max_bytes=cap)
    want = built(uncached_stream(n), EPOCHS)
    queue = queues()
    argv = _argv(serve_argv, queue, "cache_pipelines:cached_stream")
    first = spawn_proc(argv, env=env)
    directory = tmp_path / "c"
    disk: list[int] = []
    got: list[list[Batch]] = []
    with ServerDataStream(
        SOURCES, False, url=redis_url, queue=queue, timeout_s=60, stall_s=1.0
    ) as stream:
        wait_until(lambda: len(entries(directory)) >= 3, timeout_s=60, what="3 entries written")
        first.send_signal(signal.SIGKILL)  # most likely in a write: they are most of its work
        first.wait(timeout=10)
        killed = first.pid
        spawn_proc(argv, env=env)  # builds what the killed one left, reads what it wrote
        stable: dict[str, int] = {}
        for e in range(EPOCHS):
            epoch = []
            for batch in stream.get_epoch_iterator():
                epoch.append(_bytes(batch))
                disk.append(disk_bytes(directory))
            got.append(epoch)
            if e == 0:
                stable = {p.name: p.stat().st_mtime_ns for p in files(directory)}
        stream.close(finished=True)
    assert got == want  # nothing torn was served
    assert max(disk) <= cap  # sampled at every batch
    names = files(directory)
    segments = [(p, parse_segment_name(p.name)) for p in names if p.name.startswith("seg-")]
    assert not [p for p, seg in segments if seg is not None and seg.pid == killed]  # sealed
    ends = index_ends(str(names[0].parent))
    for p, seg in segments:  # no byte past the last indexed entry: the torn tail was cut
        assert seg is not None and p.stat().st_size == ends[seg.token]
    held = entries(directory)
    assert len(held) == n // 2  # the stable half
    assert {p.name: p.stat().st_mtime_ns for p in names} == stable  # no rewrite after epoch 1
    for (_, index), place in held.items():  # every entry whole: its checksum, stage, index
        image, label = decode_entry(entry_bytes(place), fingerprint, index, _TENSORS)
        assert label == index and image.shape[0] == 3
