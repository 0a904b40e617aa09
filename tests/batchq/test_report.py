"""batchq report: the history list as a picture, and clear errors when it cannot be drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis

from batchq.cli import main
from batchq.cli.report import load_history
from batchq.keys import QueueKeys


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
