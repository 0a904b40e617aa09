"""batchq report: the history list as a picture, and clear errors when it cannot be drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis

from batchq.cli import main
from batchq.cli.report import load_history
from batchq.protocol.keys import QueueKeys


def _history(client: redis.Redis, queue: str, n: int = 30) -> None:
    keys = QueueKeys(queue)
    client.hset(keys.meta, mapping={"run": "r", "hwm": 8})
    samples = [
        {"t": 1000.0 + i, "depth": i % 9, "batches": 30 * i, "stall": (i % 5) / 10,
         "batches_per_s": 30.0, "mb_per_s": 3.1}
        for i in range(n)
    ]  # fmt: skip
    client.lpush(keys.history, *[json.dumps(s) for s in samples])  # newest ends up first
    client.lpush(keys.history, b"not json")  # skipped


def test_history_is_read_oldest_first(redis_client: redis.Redis, queue_name: str) -> None:
    _history(redis_client, queue_name, n=5)
    samples = load_history(redis_client, queue_name)
    assert [s["t"] for s in samples] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]


def test_report_writes_a_png(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from matplotlib.image import imread

    _history(redis_client, queue_name)
    out = tmp_path / "report.png"
    assert main(["report", "--url", redis_url, "--queue", queue_name, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(str(out)).shape[:2] == (750, 1000)  # 10 x 7.5 inches at 100 dpi
    assert "30 samples" in capsys.readouterr().out


def test_report_errors_name_what_is_missing(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["report", "--url", redis_url, "--queue", queue_name, "--out"]
    assert main([*argv, str(tmp_path / "r.png")]) == 2
    assert f"queue {queue_name!r} has no history" in capsys.readouterr().err
    _history(redis_client, queue_name)
    assert main([*argv, str(tmp_path / "missing" / "r.png")]) == 2
    assert "--out" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([*argv, str(tmp_path / "r.png")]) == 2
    assert "pip install 'batchq[report]'" in capsys.readouterr().err


def test_report_json_prints_what_it_wrote_and_the_plotted_series(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _history(redis_client, queue_name)
    redis_client.hset(QueueKeys(queue_name).stats, "quarantined", 3)
    out = tmp_path / "report.png"
    argv = ["report", "--url", redis_url, "--queue", queue_name, "--out", str(out), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout: one JSON document
    assert list(doc) == [
        "queue", "out", "samples", "span_s", "mean_stall", "hwm", "world_size", "groups",
        "run", "quarantined", "quarantined_run", "cache_hits", "cache_misses",
        "cache_hit_rate", "cache_bytes", "cache_saved_s", "cache_saved_ms_per_batch", "series",
    ]  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # written all the same
    assert doc["queue"] == queue_name and doc["out"] == str(out)
    assert (doc["samples"], doc["span_s"], doc["hwm"]) == (30, 29.0, 8)
    assert (doc["world_size"], doc["groups"]) == (1, [])
    assert doc["mean_stall"] == pytest.approx(0.2)
    assert (doc["run"], doc["quarantined"], doc["quarantined_run"]) == ("r", 3, 0)
    assert doc["cache_hits"] is None  # no producer caches
    series = doc["series"]
    assert list(series) == [
        "t", "depth", "stall", "batches_per_s", "mb_per_s", "producers", "demand", "supply",
        "delivered",
    ]  # fmt: skip
    assert series["t"] == [float(i) for i in range(30)]
    assert series["depth"][:10] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert series["stall"][:3] == [0.0, 0.1, 0.2]
    assert series["producers"] == [None] * 30  # these samples carry no queue side
    assert series["demand"][1] == pytest.approx(30.0 / 0.9)


def _pool_history(n: int = 40) -> list[dict[str, object]]:
    """A run whose pool grew from 1 to 3 producers at sample 10 and shrank to 2 at 30."""
    out, pushed, built, build_ms = [], 0, 0, 0
    for i in range(n):
        producers = 1 if i < 10 else 3 if i < 30 else 2
        pushed += 10 * producers
        built += 10 * producers
        build_ms += 1000 * producers
        out.append(
            {"t": 1000.0 + i, "depth": 0, "batches": 10 * i, "stall": 0.5,
             "batches_per_s": 10.0, "mb_per_s": 1.0, "producers": producers,
             "pushed": pushed, "built": built, "build_ms": build_ms}
        )  # fmt: skip
    return out


def test_sizing_series_gives_demand_supply_and_the_joins_and_leaves() -> None:
    from batchq.cli.report import sizing_series

    samples = _pool_history()
    sz = sizing_series(samples)
    assert sz["demand"][0] == pytest.approx(20.0)  # 10 b/s while waiting half the time
    assert sz["supply"][0] is None and sz["supply"][5] == pytest.approx(10.0)
    assert sz["supply"][20] == pytest.approx(30.0)  # 3 producers at 10/s each
    assert sz["delivered"][20] == pytest.approx(30.0)
    assert [(i, c) for i, c in enumerate(sz["change"]) if c] == [(10, 2.0), (30, -1.0)]
    old = sizing_series([{"t": 1.0, "stall": 0.1}, {"t": 2.0, "stall": "x"}])  # version 2
    assert old["producers"] == [None, None] and old["supply"] == [None, None]


def test_report_draws_the_pool(
    redis_url: str, redis_client: redis.Redis, queue_name: str, tmp_path: Path
) -> None:
    keys = QueueKeys(queue_name)
    redis_client.hset(keys.meta, mapping={"run": "r", "hwm": 8})
    redis_client.lpush(keys.history, *[json.dumps(s) for s in _pool_history()])
    out = tmp_path / "pool.png"
    assert main(["report", "--url", redis_url, "--queue", queue_name, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_draws_a_line_per_group(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = QueueKeys(queue_name)
    _history(redis_client, queue_name)  # slot 0's (group a)
    redis_client.lpush(keys.slot_view(1).history, json.dumps({"t": 1003.0, "depth": 2}))
    redis_client.hset(keys.groups, mapping={"a": 0, "trial-2": 1})
    drawn: dict[str, object] = {}

    def plot(samples: object, out: object, **kwargs: object) -> Path:
        drawn.update(kwargs)
        return Path(str(out))

    monkeypatch.setattr("batchq.cli.report.plot_report", plot)
    out = tmp_path / "report.png"
    assert main(["report", "--url", redis_url, "--queue", queue_name, "--out", str(out)]) == 0
    groups = drawn["groups"]
    assert isinstance(groups, dict) and list(groups) == ["a", "trial-2"]
    assert [len(groups["a"]), len(groups["trial-2"])] == [30, 1]


def test_a_report_of_groups_is_drawn(tmp_path: Path) -> None:
    from batchq.cli.report import plot_report

    samples = [{"t": 1000.0 + i, "depth": i, "stall": 0.1, "batches_per_s": 5.0} for i in range(5)]
    out = plot_report(samples, tmp_path / "g.png", queue="q", groups={"a": samples, "": samples})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
