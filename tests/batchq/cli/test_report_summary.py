"""What runs served by `batchq serve` processes show beside their figures over time:
the examples a run quarantined (issue 42: `status`, the exporter and `report`) and the
producers' cache figures once they stopped (issue 41: `report`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

torch = pytest.importorskip("torch")

from batchq.cli import main  # noqa: E402
from batchq.client.connection import make_client  # noqa: E402
from batchq.monitoring.exporter import BatchqCollector  # noqa: E402
from batchq.monitoring.rows import queue_status, row_from_snapshot  # noqa: E402
from batchq.monitoring.snapshot import read_snapshots  # noqa: E402
from batchq.protocol.fields import ProducerStat, parse_producer_stat_field  # noqa: E402
from batchq.protocol.keys import QueueKeys  # noqa: E402
from batchq.protocol.layout import read_quarantine  # noqa: E402
from consumer import ServerDataStream  # noqa: E402

BAD = (5, 17)


def _read(
    url: str,
    queue: str,
    sources: tuple[str, ...],
    epochs: int,
    before_finish: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Read ``epochs`` epochs, call ``before_finish``, finish the run; the stream's
    last stats."""
    with ServerDataStream(sources, False, url=url, queue=queue, timeout_s=60) as stream:
        for _ in range(epochs):
            assert sum(1 for _ in stream.get_epoch_iterator()) > 0
        stats = dict(stream.stats)
        if before_finish is not None:
            before_finish()
        stream.close(finished=True)
    return stats


def _exported(url: str, queue: str) -> dict[str, float]:
    """One scrape of the collector: {sample name: value} of the queue's samples."""
    registry = CollectorRegistry(auto_describe=False)
    client = make_client(url)
    try:
        registry.register(BatchqCollector(client, [queue]))
        text = generate_latest(registry).decode()
    finally:
        client.close()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels == {"queue": queue}
    }


def _report(url: str, queue: str, out: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    assert main(["report", "--url", url, "--queue", queue, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {out}")
    return lines[1:]


def test_quarantined_examples_are_counted_by_status_the_exporter_and_report(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = serve_env(examples=60, batch_size=10, bad=",".join(map(str, BAD)))
    argv = serve_argv("--hwm", "4", factory="torch_pipelines:broken_stream")
    proc = spawn_proc(
        [*argv, "--on-sample-error", "quarantine", "--max-quarantined", "0.05"], env=env
    )
    stats = _read(redis_url, queue_name, ("index", "aug"), epochs=2)
    assert stats["quarantined"] == len(BAD)  # each once per run, whatever the epochs
    assert proc.wait(timeout=30) == 0
    row = queue_status(redis_client, queue_name)
    assert row["quarantined"] == row["quarantined_run"] == len(BAD)
    found = read_quarantine(redis_client, QueueKeys(queue_name))
    assert found.run == row["run"] and sorted(r["index"] for r in found.records) == list(BAD)
    exported = _exported(redis_url, queue_name)
    assert exported["batchq_quarantined_examples_total"] == len(BAD)
    assert exported["batchq_run_quarantined_examples"] == len(BAD)
    line = (
        f"  quarantined examples: {len(BAD)} in run {row['run']}, {len(BAD)} since the keys "
        "were created (replaced by substitutes; `batchq dead` lists them)"
    )
    assert main(["status", "--url", redis_url, "--queue", queue_name]) == 0
    assert line in capsys.readouterr().out.splitlines()
    lines = _report(redis_url, queue_name, tmp_path / "r.png", capsys)
    assert lines == [line]  # nothing cached: no cache line
    # A new run of the queue: the run's count starts again, the counter goes on.
    redis_client.hset(QueueKeys(queue_name).meta, "run", "the-next-run")
    row = queue_status(redis_client, queue_name)
    assert (row["quarantined"], row["quarantined_run"]) == (len(BAD), 0)
    assert _exported(redis_url, queue_name)["batchq_run_quarantined_examples"] == 0


def _pstats_cache(client: redis.Redis, queue: str) -> dict[str, int]:
    """The producers' counters in the pstats hash, summed per name, read here."""
    totals: dict[str, int] = {}
    for raw, value in client.hgetall(QueueKeys(queue).pstats).items():
        parsed = parse_producer_stat_field(raw.decode())
        if parsed is not None:
            totals[parsed[1]] = totals.get(parsed[1], 0) + int(value)
    return totals


def test_report_shows_the_cache_figures_of_producers_that_stopped(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 32
    env = serve_env(examples=n, cache_dir=tmp_path / "cache")
    argv = serve_argv(
        "--hwm", "4", "--heartbeat-ttl-s", "1", factory="cache_pipelines:cached_stream"
    )
    proc = spawn_proc(argv, env=env)

    def live_row() -> None:
        """While the producer lives, the status row's saved time per batch is its
        figures' (one read: the row and the pstats counters of the same moment)."""

        def beaten() -> tuple[Any, dict[str, Any]] | None:
            """A snapshot and its row once the heartbeat wrote both epochs' figures."""
            (snap,) = read_snapshots(redis_client, [queue_name])
            row = row_from_snapshot(snap)
            hits = row["cache_hits"]
            return (snap, row) if hits is not None and hits + row["cache_misses"] >= 2 * n else None

        snap, row = wait_until(beaten, what="the producer's cache figures")
        (p,) = row["producers"]
        counters = snap.pstats[p["id"]]
        saved = counters[ProducerStat.CACHE_SAVED_MS] / counters[ProducerStat.BATCHES]
        assert row["cache_saved_ms_per_batch"] == pytest.approx(saved)

    _read(redis_url, queue_name, ("image", "label"), epochs=2, before_finish=live_row)
    assert proc.wait(timeout=30) == 0  # its last cache figures written at its stop
    wait_until(
        lambda: queue_status(redis_client, queue_name)["producers_alive"] == 0,
        what="the producer to leave",
    )
    row = queue_status(redis_client, queue_name)
    assert row["cache_hits"] is None  # status: the live producers' figures, none now
    c = _pstats_cache(redis_client, queue_name)
    hits, misses = c[ProducerStat.CACHE_HITS], c[ProducerStat.CACHE_MISSES]
    # Epoch 1 built every example, epoch 2 read every one from the cache.
    assert misses >= n and hits >= n
    per_batch = c[ProducerStat.CACHE_SAVED_MS] / c[ProducerStat.BATCHES]
    (line,) = _report(redis_url, queue_name, tmp_path / "r.png", capsys)
    assert line.startswith(
        f"  cache: hits {100 * hits / (hits + misses):.0f}% ({hits} of {hits + misses} examples)"
    )
    assert line.endswith(f"({per_batch:.1f} ms per batch)")
