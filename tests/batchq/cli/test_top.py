"""batchq top: sparklines, rates from its own samples, and a screen that fits 80x24."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rich.console import Console

from batchq.cli import main
from batchq.cli.top import SPARK_WIDTH, TopState, render_top, run_top, sparkline
from batchq.monitoring.rows import PRODUCER_FIELDS, STATUS_FIELDS, STATUS_SCHEMA_VERSION
from batchq.monitoring.snapshot import QueueSnapshot, read_snapshots
from batchq.protocol.keys import QueueKeys
from batchq.wire.codec import FrameHeader, FrameKind, encode_frame


def test_sparkline_scales_to_the_top_and_keeps_the_newest() -> None:
    assert sparkline([0, 5, 10], 10, width=3) == "▁▅█"
    assert sparkline([1.0], 1.0, width=4) == "   █"
    assert sparkline(range(0, 100, 10), 90, width=3) == "▆▇█"  # the newest three
    assert sparkline([], 10, width=2) == "  "
    assert sparkline([2, 4], 0, width=2) == "▅█"  # no top given: the largest value


def _snap(queue: str, now_ms: int, pushed: int, popped: int, **kw: Any) -> QueueSnapshot:
    base: dict[str, Any] = {
        "meta": {"run": "r", "hwm": "10"},
        "depth": 4,
        "alive": {},
        "stats": {"pushed": pushed, "popped": popped},
        "dead": 0,
        "pstats": {},
        "trainer": {},
    }
    base.update(kw)
    return QueueSnapshot(queue=queue, now_ms=now_ms, **base)


def test_rates_come_from_two_reads_over_the_servers_clock() -> None:
    state = TopState(width=8)
    history = [{"t": 1.0, "depth": d, "stall": 0.5} for d in (3, 2, 1)]  # newest first
    (first,) = state.update([_snap("q", 10_000, 100, 90, history=history)])
    assert first["rate_in"] is None and first["rate_out"] is None
    assert list(state.depth["q"]) == [1, 2, 3, 4]  # the history, oldest first, then this read
    assert list(state.stall["q"]) == [0.5, 0.5, 0.5]  # no fresh figures: nothing appended
    alive, pstats = {"p": 99e12}, {"p": {"batches": 10, "produce_ms": 100}}
    state.update([_snap("q", 11_000, 100, 90, alive=alive, pstats=pstats)])
    pstats["p"]["batches"] = 40
    (second,) = state.update([_snap("q", 13_000, 150, 130, alive=alive, pstats=pstats)])
    assert second["rate_in"] == pytest.approx(25.0)  # 50 frames in 2 s of server time
    assert second["rate_out"] == pytest.approx(20.0)
    assert second["producers"][0]["rate"] == pytest.approx(15.0)  # 30 frames in 2 s


def test_the_first_screen_takes_its_rates_from_the_stored_history() -> None:
    # 11 samples a second apart, newest first: 12 frames pushed and 10 taken a second.
    history = [
        {"t": 100.0 - i, "depth": 2, "stall": 0.5, "pushed": 1000 - 12 * i,
         "batches": 900 - 10 * i, "producers": 2, "built": 500 - 6 * i,
         "build_ms": 50_000 - 600 * i}
        for i in range(11)
    ]  # fmt: skip
    trainer = {"stall_fraction_recent": "0.5", "batches_per_s": "10", "updated_ms": "100000"}
    alive = {"h-1-a": 2e14, "h-2-b": 2e14}
    (row,) = TopState().update([_snap("q", 100_000, 1000, 900, history=history,
                                       trainer=trainer, alive=alive)])  # fmt: skip
    assert row["rate_in"] == pytest.approx(12.0)
    assert row["rate_out"] == pytest.approx(10.0)
    # demand 10 / (1 - 0.5) = 20 b/s; each producer 10/s: 2 x 1.05 -> 3.
    assert row["demand_batches_per_s"] == pytest.approx(20.0)
    assert row["producer_batches_per_s"] == pytest.approx(10.0)
    assert row["recommended_producers"] == 3


@pytest.fixture
def busy_queue(redis_client: redis.Redis, queue_name: str) -> Iterator[str]:
    """A queue that looks like a run in progress: two producers, a trainer, history."""
    keys = QueueKeys(queue_name)
    sec, usec = redis_client.time()
    now_ms, now = sec * 1000 + usec // 1000, sec + usec / 1e6
    redis_client.hset(
        keys.meta,
        mapping={"run": "r" * 16, "hwm": 10, "epoch_batches": 100, "claim": "t",
                 "claim_deadline": now_ms + 60_000},
    )  # fmt: skip
    producers = {f"host-{i}-{'x' * 40}": now_ms + 30_000 for i in range(4)}
    redis_client.zadd(keys.producers, producers)
    for p in producers:
        redis_client.hset(keys.pstats, mapping={f"{p}:batches": 50, f"{p}:produce_ms": 1500})
    frame = encode_frame(
        FrameHeader(FrameKind.END, run="r", epoch=0, shard=0, k=0, producer="p", count=0)
    )
    redis_client.lpush(keys.data, *[bytes(frame)] * 2)
    redis_client.hset(keys.stats, mapping={"pushed": 200, "popped": 198})
    redis_client.hset(
        keys.trainer,
        mapping={"stall_fraction_recent": 0.62, "batches_per_s": 33.3, "epoch": 2,
                 "epoch_progress": 45, "updated_ms": now_ms},
    )  # fmt: skip
    samples = [
        {"t": now - i, "depth": i % 3, "stall": 0.6, "pushed": 200 - 5 * i, "batches": 198 - 5 * i}
        for i in range(40)
    ]
    redis_client.lpush(keys.history, *[json.dumps(s) for s in reversed(samples)])
    yield queue_name


def test_the_screen_fits_80_by_24(redis_client: redis.Redis, busy_queue: str) -> None:
    state = TopState()
    rows = state.update(read_snapshots(redis_client, [busy_queue], history=state.width))
    console = Console(record=True, width=80, height=24, color_system=None)
    console.print(render_top(rows, state, where="redis://127.0.0.1:1/0"))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert f"{busy_queue} INPUT-BOUND" in text
    assert "2/10" in text and "62%" in text and "2 (45/100)" in text
    assert "producers 4 alive, need 3 (demand 87.6 b/s, 33.3 each)" in text
    assert "... 1 more" in text
    assert "in 5.0/s out 5.0/s" in text  # from the history, on the very first screen
    assert "builds   33.3/s" in text  # each producer: 50 batches in 1.5 s of pipeline time
    assert "▁" in text or "█" in text  # sparklines drawn


def test_top_once_prints_one_screen(
    redis_url: str, busy_queue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(url=redis_url, queue=busy_queue, interval=1.0, once=True, json=False)
    console = Console(record=True, width=80, height=24, color_system=None)
    assert run_top(args, console=console) == 0
    assert "INPUT-BOUND" in console.export_text()
    bad = argparse.Namespace(url=redis_url, queue=None, interval=0, once=True, json=False)
    with pytest.raises(ValueError, match="--interval 0"):
        run_top(bad)


def test_top_once_json_prints_the_status_rows_with_the_rates_and_the_sparklines(
    redis_url: str, busy_queue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", "--once", "--json", "--url", redis_url, "--queue", busy_queue]) == 0
    (row,) = json.loads(capsys.readouterr().out)  # stdout: one JSON document
    assert tuple(row) == (*STATUS_FIELDS, "rate_in", "rate_out", "depth_series", "stall_series")
    assert row["schema"] == STATUS_SCHEMA_VERSION
    assert row["queue"] == busy_queue and row["verdict"] == "input-bound"
    assert all(tuple(p) == PRODUCER_FIELDS for p in row["producers"])
    assert row["rate_in"] == pytest.approx(5.0) and row["rate_out"] == pytest.approx(5.0)
    assert len(row["depth_series"]) == SPARK_WIDTH and row["depth_series"][-1] == 2
    assert row["stall_series"][-1] == pytest.approx(0.62)  # this read's, after the history


def test_top_json_without_once_is_refused(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", "--json", "--url", redis_url]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("batchq top: --json needs --once")


def _poll(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_runs_live_in_an_80x24_terminal_and_quits_on_ctrl_c(
    redis_url: str, busy_queue: str, tmp_path: Path
) -> None:
    sock, rc = str(tmp_path / "tmux.sock"), tmp_path / "rc"
    tmux = ["tmux", "-S", sock]
    cmd = (
        f"{sys.executable} -m batchq.cli top --url {redis_url} --queue {busy_queue} "
        f"--interval 0.2; echo $? > {rc}"
    )
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "80", "-y", "24", cmd], check=True, timeout=10
    )
    try:

        def screen() -> str:
            out = subprocess.run(
                [*tmux, "capture-pane", "-p"], capture_output=True, text=True, timeout=10
            )
            return out.stdout if "INPUT-BOUND" in out.stdout else ""

        text = _poll(screen, what="top's first screen")
        lines = text.rstrip("\n").splitlines()
        assert len(lines) <= 24 and max(map(len, lines)) <= 80
        assert any(line.lstrip("│ ").startswith("depth") for line in lines)
        subprocess.run([*tmux, "send-keys", "C-c"], check=True, timeout=10)
        assert _poll(lambda: rc.exists() and rc.read_text().strip(), what="top to quit") == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10, check=False)
