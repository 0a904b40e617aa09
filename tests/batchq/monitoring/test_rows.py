"""status: the figures are right (not merely present), the verdict, and the JSON schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from batchq.cli import main
from batchq.errors import ConfigError, FrameError
from batchq.monitoring import rows as monitor
from batchq.monitoring.rows import PRODUCER_FIELDS, STATUS_FIELDS, row_from_snapshot, status_rows
from batchq.monitoring.snapshot import read_snapshots
from batchq.monitoring.verdict import STALL_INPUT_BOUND, judge, near_cap
from batchq.protocol.fields import StatsField
from batchq.protocol.keys import QueueKeys
from batchq.wire.codec import FrameHeader, encode_frame, peek_header
from batchq.wire.codec import FrameKind as K
from batchq.wire.frame import encode_ref
from batchq.wire.shm import segment_name
from consumer import ServerDataStream
from producer import Producer

# --------------------------------------------------------------------------- peek_header


def _frame(t: float | None = 123.5, n: int = 1000) -> bytes:
    data = (np.arange(n, dtype=np.float32),)
    header = FrameHeader(
        K.BATCH, run="r", epoch=1, shard=2, k=0, producer="p", sources=("x",), produced_at=t
    )
    return bytes(encode_frame(header, data))


def test_peek_header_reads_a_truncated_frame_and_validates_like_decode() -> None:
    whole = _frame()
    hlen = int.from_bytes(whole[8:12], "little")
    for buf in (whole, whole[: 12 + hlen], memoryview(whole)[:100_000]):
        header = peek_header(buf)
        assert header["t"] == 123.5 and header["ep"] == 1 and header["pid"] == "p"
    assert "t" not in peek_header(_frame(t=None))
    with pytest.raises(FrameError) as e:
        peek_header(whole[: 12 + hlen - 1])
    assert e.value.reason == "too_short"
    cases = {
        b"": "too_short",
        b"XYZ" + whole[3:]: "bad_magic",
        whole[:3] + b"\x09" + whole[4:]: "bad_version",
        whole[:4] + b"\x07" + whole[5:]: "bad_kind",
        whole[:5] + b"\x01" + whole[6:]: "bad_header",
        whole[:12] + b"\xc1" * hlen: "bad_header",  # not msgpack
    }
    for buf, reason in cases.items():
        with pytest.raises(FrameError) as e:
            peek_header(buf)
        assert e.value.reason == reason, buf[:16]
    with pytest.raises(ConfigError, match="str"):
        peek_header("BQF")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the verdict


@pytest.mark.parametrize(
    ("trainer", "alive", "depths", "hwm", "stall", "verdict"),
    [
        ("finished", 2, [10], 10, 0.0, "idle"),
        ("detached", 2, [10], 10, None, "idle"),
        ("attached", 0, [0], 10, 0.0, "input-bound"),  # nobody to feed it
        ("attached", 1, [0], 10, None, "unknown"),  # no figures yet
        ("attached", 1, [10], 10, None, "trainer-bound"),  # full, whatever its figures
        ("attached", 1, [0, 1, 0], 10, 0.6, "input-bound"),
        ("attached", 1, [10, 10, 9], 10, STALL_INPUT_BOUND, "input-bound"),  # head of line
        ("attached", 1, [10, 9, 10], 10, 0.01, "trainer-bound"),
        ("attached", 1, [2, 9, 3], 10, 0.03, "balanced"),
        ("attached", 1, [3], 4, 0.0, "trainer-bound"),  # within one of a small cap
    ],
)
def test_the_verdict_rule(
    trainer: str, alive: int, depths: list[float], hwm: int, stall: float | None, verdict: str
) -> None:
    got, reason = judge(trainer=trainer, producers_alive=alive, depths=depths, hwm=hwm, stall=stall)
    assert got == verdict, reason
    assert reason


def test_near_cap_is_three_quarters_or_one_frame_short() -> None:
    assert [d for d in range(11) if near_cap(d, 10)] == [8, 9, 10]
    assert [d for d in range(5) if near_cap(d, 4)] == [3, 4]
    assert [d for d in range(3) if near_cap(d, 2)] == [1, 2]
    assert [d for d in range(2) if near_cap(d, 1)] == [1]
    assert not near_cap(5, 0)


# --------------------------------------------------------------------------- the schema


def _documented(section: str) -> dict[str, str]:
    """Field -> type, as monitor's docstring documents them, in order."""
    doc = monitor.__doc__ or ""
    status, producer = doc.split("A producer object")
    text = status if section == "status" else producer
    types = r"str\|null|int\|null|float\|null|object\|null|str|int|float|object|list|bool"
    spec = re.compile(rf"^    (\w+)\s+({types})\s+\S")
    return {m[1]: m[2] for line in text.splitlines() if (m := spec.match(line))}


def test_the_docstring_documents_every_field_in_order() -> None:
    assert tuple(_documented("status")) == STATUS_FIELDS
    assert tuple(_documented("producer")) == PRODUCER_FIELDS
    assert STATUS_FIELDS[:13] == (  # schema version 1, unchanged
        "queue", "run", "depth", "hwm", "producers_alive", "leases", "shards_per_epoch",
        "epoch_batches", "pushed", "popped", "pushed_bytes", "trainer", "dead",
    )  # fmt: skip


def test_the_docstring_states_the_schema_version_of_the_constant() -> None:
    doc = monitor.__doc__ or ""
    assert re.findall(r"schema version (\d+);", doc) == [str(monitor.STATUS_SCHEMA_VERSION)]
    assert re.findall(r"(\d+) \(STATUS_SCHEMA_VERSION\)", doc) == [
        str(monitor.STATUS_SCHEMA_VERSION)
    ]


_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float, int),  # JSON writes 0.0 as 0.0, but a float field may hold an int
    "object": (dict,),
    "list": (list,),
    "float|null": (float, int, type(None)),
    "int|null": (int, type(None)),
    "str|null": (str, type(None)),
    "object|null": (dict, type(None)),
    "bool": (bool,),
}


def check_schema(row: dict[str, Any]) -> None:
    """Assert a status row (parsed JSON) matches the documented schema exactly."""
    assert tuple(row) == STATUS_FIELDS
    for name, typ in _documented("status").items():
        assert isinstance(row[name], _TYPES[typ]), name
        assert typ == "bool" or not isinstance(row[name], bool), name  # a number, not a flag
    assert row["schema"] == monitor.STATUS_SCHEMA_VERSION == 6
    for p in row["producers"]:
        assert tuple(p) == PRODUCER_FIELDS
        for name, typ in _documented("producer").items():
            assert isinstance(p[name], _TYPES[typ]), name


# --------------------------------------------------------------------------- bytes and ages


def test_bytes_held_and_oldest_age_of_inline_and_referenced_frames(
    redis_client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    sec, usec = redis_client.time()
    now = sec + usec / 1e6
    ref_key = keys.frame("r", "p", 1)
    big = _frame(t=now - 7.0, n=100_000)  # 400 kB: the header is in its first 64 KiB
    redis_client.set(ref_key, big)
    redis_client.lpush(keys.data, encode_ref(ref_key))  # the oldest element
    redis_client.lpush(keys.data, _frame(t=now - 1.0))
    # No live producer: the mean frame size comes from the queue's counters.
    redis_client.hset(keys.stats, mapping={"pushed": 2, "pushed_bytes": len(big) + len(_frame())})
    (row,) = status_rows(redis_client, [queue_name])
    assert row["oldest_age_s"] == pytest.approx(7.0, abs=0.5)
    assert row["bytes_held"] == len(big) + len(_frame())
    redis_client.rpop(keys.data)  # now the inline frame is the oldest
    assert status_rows(redis_client, [queue_name])[0]["oldest_age_s"] == pytest.approx(1, abs=0.5)
    redis_client.rpush(keys.data, b"not a frame")  # the oldest now
    assert status_rows(redis_client, [queue_name])[0]["oldest_age_s"] is None
    redis_client.delete(keys.data)
    (row,) = status_rows(redis_client, [queue_name])
    assert row["bytes_held"] == 0 and row["oldest_age_s"] is None  # empty: exactly 0


@pytest.fixture
def producer(redis_url: str, queue_name: str) -> Iterator[Callable[..., Producer]]:
    started: list[tuple[Producer, threading.Thread]] = []

    def start(stream: Any, hwm: int) -> Producer:
        p = Producer(stream, redis_url, queue_name, hwm=hwm)
        thread = threading.Thread(target=p.serve, daemon=True)
        thread.start()
        started.append((p, thread))
        return p

    yield start
    for p, thread in started:
        p.stop()
        thread.join(timeout=10)


def _poll(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def test_a_snapshot_of_no_history_reads_none(redis_client: redis.Redis, queue_name: str) -> None:
    keys = QueueKeys(queue_name)
    redis_client.hset(keys.meta, mapping={"run": "r", "hwm": 4})
    redis_client.lpush(keys.history, *[json.dumps({"t": 1000.0 + i, "depth": i}) for i in range(5)])
    wanted = {0: [], 2: [1004.0, 1003.0], -1: [1004.0 - i for i in range(5)]}
    for history, times in wanted.items():
        (snap,) = read_snapshots(redis_client, [queue_name], history=history)
        assert [s["t"] for s in snap.history] == times, history


def test_bytes_held_is_exact_for_a_full_queue_without_a_trainer(
    redis_client: redis.Redis, queue_name: str, producer: Callable[..., Producer]
) -> None:
    from pipelines import numbered

    keys = QueueKeys(queue_name)
    producer(numbered(200, 20), hwm=3)
    _poll(lambda: redis_client.llen(keys.data) == 3, what="a full queue")
    (row,) = status_rows(redis_client, [queue_name])
    assert row["bytes_held"] == sum(len(e) for e in redis_client.lrange(keys.data, 0, -1))
    assert row["fill"] == 1.0 and row["leases"] >= 1
    assert row["verdict"] == "idle" and "no trainer" in row["verdict_reason"]
    assert 0 <= row["oldest_age_s"] < 60


# --------------------------------------------------------------------------- live runs


@dataclass
class Run:
    """A trainer in a thread that records, by its own clock, when it asked for each batch
    and when it had it."""

    asked: list[float] = field(default_factory=list)
    got: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)
    #: With a full list: the wall time (the history's clock) from which every pop the
    #: reader made came after a take from a full list.
    full_since: float | None = None

    def expected(self, batches: int) -> tuple[float, float]:
        """(stall fraction, batches/s) over the last 100 of the first ``batches``."""
        first = max(0, batches - 100)
        waits = [self.got[i] - self.asked[i] for i in range(first, batches)]
        busy = [self.asked[i] - self.got[i - 1] if i else 0.0 for i in range(first, batches)]
        spent = sum(waits) + sum(busy)
        return sum(waits) / spent, len(waits) / spent


def _wait_full(client: redis.Redis, keys: QueueKeys, hwm: int, popped: int, run: Run) -> int:
    """Wait until the reader popped since the last take (the queue's ``popped`` counter
    passed ``popped``) and the producer filled the list to ``hwm`` again; the counter."""
    deadline = time.monotonic() + 20.0
    while not run.stop.is_set():
        now = int(client.hget(keys.stats, StatsField.POPPED) or 0)
        if now > popped and client.llen(keys.data) >= hwm:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"the list did not fill to {hwm} again")
        time.sleep(0.001)
    return popped


def _train(url: str, queue: str, train_s: float, run: Run, full: int | None = None) -> None:
    """The trainer's loop; with ``full`` (the hwm) each batch is taken from a full list
    only, after the reader's pop for the last one: producers wait for it by construction,
    however late the CPU lets them refill (a trainer-bound run)."""
    client = redis.Redis.from_url(url)
    keys, popped = QueueKeys(queue), -1
    try:
        with ServerDataStream(("features", "targets"), url=url, queue=queue) as stream:
            it = stream.get_epoch_iterator()
            while not run.stop.is_set():
                if full is not None:
                    popped = _wait_full(client, keys, full, popped, run)
                    if len(run.got) == 2:  # the pop for the 2nd take came after it
                        run.full_since = time.time()
                run.asked.append(time.monotonic())
                if next(it, None) is None:
                    break
                run.got.append(time.monotonic())
                time.sleep(train_s)  # the trainer's known work per batch
    except BaseException as e:  # reported by the test
        run.error.append(e)
    finally:
        client.close()


def _steady(history: list[bytes], since: float | None) -> bool:
    """Whether most of the trainer's history samples (two at least) were written after
    ``since``: their depths, and so the verdict's median, are those of the steady state
    (a sample carries the depth the previous pop saw: the first ones, the list filling)."""
    if since is None:
        return False
    after = sum(json.loads(h)["t"] > since for h in history)
    return after >= 2 and 2 * after > len(history)


@pytest.mark.parametrize(
    ("load_ms", "train_ms", "verdict"), [(30, 5, "input-bound"), (2, 20, "trainer-bound")]
)
def test_live_figures_and_verdict_match_the_runs_own_clock(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer: Callable[..., Producer],
    load_ms: float,
    train_ms: float,
    verdict: str,
) -> None:
    from pipelines import Slow, numbered

    keys = QueueKeys(queue_name)
    hwm = 4
    producer(Slow(numbered(3000, 10, shuffled=False), slowdown=load_ms / 1000), hwm=hwm)
    run = Run()
    # Trainer-bound: each batch taken from a full list (a 2 ms pipeline refills it well
    # within the 20 ms, but not on a loaded machine, where the depth then dips).
    full = hwm if verdict == "trainer-bound" else None
    trainer = threading.Thread(
        target=_train, args=(redis_url, queue_name, train_ms / 1000, run, full)
    )
    trainer.start()

    def ready() -> bool:
        """Two flushes of the trainer's figures and 40 batches; trainer-bound, most of
        the samples in the steady state (the first ones, up to a few forced by the
        reader's floor at the start, carry the depth of the list filling)."""
        history = redis_client.lrange(keys.history, 0, -1)
        enough = len(history) >= 2 and len(run.got) >= 40
        return enough and (full is None or _steady(history, run.full_since))

    try:
        _poll(lambda: ready() or run.error, what="the trainer's figures")
        snap = read_snapshots(redis_client, [queue_name])[0]
        row = row_from_snapshot(snap)
        cli = None
        if verdict == "input-bound":  # the real output of the command, once
            argv = ["status", "--url", redis_url, "--json", "--queue", queue_name]
            cli = subprocess.run(
                [sys.executable, "-m", "batchq.cli", *argv],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
    finally:
        run.stop.set()
        trainer.join(timeout=30)
    assert not run.error, run.error
    newest = snap.history[0]  # written with the figures the row shows
    stall, rate = run.expected(newest["batches"])
    assert row["stall"] == pytest.approx(stall, abs=0.03)
    assert newest["stall"] == pytest.approx(row["stall"], abs=1e-3)
    assert row["trainer_batches_per_s"] == pytest.approx(rate, rel=0.05)
    assert row["verdict"] == verdict, row["verdict_reason"]
    assert row["trainer"] == "attached" and row["producers_alive"] == 1
    assert row["epoch"] == 0 and row["epoch_batches"] == 300
    assert 0 < row["epoch_progress"] <= len(run.got)
    (p,) = row["producers"]
    assert p["build_ms_per_batch"] >= load_ms  # its pipeline sleeps that long per batch
    if verdict == "input-bound":
        assert stall > 0.5
        # The producer is the bottleneck: the trainer gets what it builds.
        assert p["batches_per_s"] == pytest.approx(rate, rel=0.2)
        assert cli is not None and cli.returncode == 0, cli.stderr if cli else ""
        (out,) = json.loads(cli.stdout)
        check_schema(out)
        assert out["verdict"] == "input-bound"
    else:
        assert stall < 0.05
        assert row["supply_batches_per_s"] > 3 * row["trainer_batches_per_s"]
        assert p["blocked_fraction"] > 0.5


def test_producer_blocked_time_is_not_more_than_the_time_it_waited(
    redis_client: redis.Redis, queue_name: str, producer: Callable[..., Producer]
) -> None:
    from pipelines import numbered

    keys = QueueKeys(queue_name)
    producer(numbered(200, 20), hwm=2)
    _poll(lambda: redis_client.llen(keys.data) == 2, what="a full queue")
    full_at = time.monotonic()
    _poll(
        lambda: int(redis_client.hget(keys.stats, "producer_blocked_ms") or 0) >= 600,
        what="blocked time to be reported",
    )
    waited_ms = (time.monotonic() - full_at) * 1000
    assert int(redis_client.hget(keys.stats, "producer_blocked_ms") or 0) <= waited_ms + 100


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("command", ["status", "top", "exporter", "report"])
def test_monitoring_commands_explain_themselves(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "--url" in capsys.readouterr().out


def test_status_table_has_a_verdict_line_per_queue(
    redis_url: str, redis_client: redis.Redis, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = QueueKeys(queue_name)
    redis_client.hset(keys.meta, mapping={"run": "r1", "hwm": 4})
    redis_client.lpush(keys.data, _frame())
    assert main(["status", "--url", redis_url, "--queue", queue_name]) == 0
    out = capsys.readouterr().out
    header, first = out.splitlines()[:2]
    assert header.split()[:3] == ["QUEUE", "DEPTH/HWM", "PRODUCERS"]
    assert first.split()[:2] == [queue_name, "1/4"]
    assert f"{queue_name}: IDLE: no trainer attached" in out


def test_status_counts_the_segments_in_the_folder_it_is_given(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_client.hset(QueueKeys(queue_name).meta, mapping={"run": "ab12", "hwm": 4})
    (tmp_path / segment_name(queue_name, "ab12", "p", 1)).write_bytes(b"\0" * 8192)
    (tmp_path / segment_name("another", "ab12", "p", 1)).write_bytes(b"\0" * 8192)
    assert monitor.queue_status(redis_client, queue_name, str(tmp_path))["shm_segments"] == 1
    argv = ["status", "--url", redis_url, "--queue", queue_name, "--json"]
    assert main([*argv, "--shm-dir", str(tmp_path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["shm_segments"] == 1 and row["shm_bytes"] >= 8192


def test_a_rank_holding_its_claim_but_sending_nothing_while_another_reads_is_unread(
    redis_client: redis.Redis, queue_name: str
) -> None:
    # Issue 39: a loop that reads on rank 0 only, rank 1's stream made and kept open: its
    # claim lives (its reader keeps it) but its trainer takes nothing.
    keys = QueueKeys(queue_name)
    sec, usec = redis_client.time()
    now_ms = sec * 1000 + usec // 1000
    deadline = now_ms + 60_000
    redis_client.hset(
        keys.meta,
        mapping={"run": "r", "hwm": 4, "world": 2, "claim_deadline:0": deadline,
                 "claim_deadline:1": deadline},
    )  # fmt: skip
    redis_client.lpush(keys.data_of(0, 2), _frame())
    redis_client.lpush(keys.data_of(1, 2), *[_frame()] * 4)
    redis_client.hset(keys.trainer_of(0, 2), "updated_ms", now_ms)  # rank 0 reads
    redis_client.hset(keys.trainer_of(1, 2), "updated_ms", now_ms - 60_000)
    rows = status_rows(redis_client, [queue_name])[0]["ranks"]
    assert [r["trainer"] for r in rows] == ["attached", "attached"]
    assert rows[0]["verdict"] != "unread" and rows[1]["verdict"] == "unread"
    assert "holds its claim but has sent no figures for 60 s" in rows[1]["verdict_reason"]
    redis_client.hset(keys.trainer_of(1, 2), "updated_ms", now_ms)  # it reads after all
    assert status_rows(redis_client, [queue_name])[0]["ranks"][1]["verdict"] != "unread"
