"""producer.cache_segment's format and producer.cache_store on it: the index's records (a
torn tail, a corrupted record, foreign bytes), a segment's torn tail, foreign files, two
writer processes on one directory, a writer killed mid-entry, the cap."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_layout import disk_bytes, entries, files, overwrite, stage_dirs

from producer import cache_segment, cache_stage, cache_store
from producer.cache_entry import decode_entry, encode_entry
from producer.cache_segment import (
    INDEX_NAME,
    RECORD_BYTES,
    SegmentWriter,
    index_records,
    pack_record,
    parse_segment_name,
    segment_name,
)
from producer.cache_stage import StageCache
from producer.cache_store import ENTRY_OVERHEAD, DiskCache

STAGE = "5e" * 32
TIMEOUT_S = 30.0
PER_WRITER = 200  # entries each writer process appends (their appends overlap)

_fork = multiprocessing.get_context("fork")


def _item(i: int, size: int = 1000) -> np.ndarray[Any, Any]:
    return np.full(size, i % 251, np.uint8)


def _write(cache: DiskCache, i: int, size: int = 1000) -> bool:
    return cache.write(STAGE, i, encode_entry(_item(i, size), STAGE, i))


def _read(cache: DiskCache, i: int) -> Any:
    raw = cache.read(STAGE, i)
    return None if raw is None else decode_entry(raw, STAGE, i)


def _entry_size(size: int = 1000) -> int:
    return len(encode_entry(_item(0, size), STAGE, 0))


# -- the index's records -------------------------------------------------------------


def test_records_round_trip_and_a_partial_one_is_left_for_later() -> None:
    raw = pack_record(7, 0xABC, 4096, 262144) + pack_record(2**60, 1, 0, 1)
    assert len(raw) == 2 * RECORD_BYTES
    records, used = index_records(raw + pack_record(3, 1, 1, 1)[:25])  # a torn tail
    assert records == [(7, 0xABC, 4096, 262144), (2**60, 1, 0, 1)]
    assert used == 2 * RECORD_BYTES  # the partial record is read again once whole


def test_a_corrupted_record_and_foreign_bytes_are_skipped_and_the_next_one_found() -> None:
    bad = bytearray(pack_record(1, 1, 0, 10))
    bad[9] ^= 0x01  # a flipped bit in the entry's index: the record's crc catches it
    raw = bytes(bad) + b"junk BQI1 not a record" + pack_record(2, 1, 10, 10)
    records, used = index_records(raw)
    assert records == [(2, 1, 10, 10)] and used == len(raw)
    # A record of a length or offset no segment has is refused as well.
    assert index_records(pack_record(3, 1, 0, 0) + pack_record(4, 1, 2**41, 1))[0] == []


def test_segment_names_say_their_writer_until_sealed() -> None:
    live = parse_segment_name(segment_name(0xF00D, 123, "host_a.b"))
    assert live is not None and (live.token, live.pid, live.host) == (0xF00D, 123, "host_a.b")
    sealed = parse_segment_name(segment_name(0xF00D))
    assert sealed is not None and (sealed.token, sealed.pid) == (0xF00D, None)
    assert parse_segment_name("index.bqi") is None and parse_segment_name("seg-xyz.bqs") is None


# -- the store on segments -----------------------------------------------------------


def test_entries_share_one_segment_and_the_ledger_is_the_files(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    assert all(_write(cache, i) for i in range(10))
    assert len(stage_dirs(tmp_path)) == 1
    assert sorted(p.name for p in files(tmp_path))[0] == INDEX_NAME
    assert len(files(tmp_path)) == 2  # the index and one segment: no file per entry
    assert cache.bytes_held() == disk_bytes(tmp_path) == 10 * (_entry_size() + ENTRY_OVERHEAD)
    other = DiskCache(tmp_path, max_bytes=10**6)  # another process's view
    assert all((_read(other, i) == _item(i)).all() for i in range(10))
    assert _read(other, 10) is None


def test_a_batch_takes_two_rounds_of_the_lock_and_reads_as_its_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    rounds = []
    locked = cache._locked

    def counted() -> Any:
        rounds.append(1)
        return locked()

    _write(cache, 0)  # the first use's recount aside
    monkeypatch.setattr(cache, "_locked", counted)
    batch = [(i, encode_entry(_item(i), STAGE, i)) for i in range(1, 9)]
    assert cache.write_many(STAGE, batch) == 8
    assert len(rounds) == 2  # the reservation, the index records: not two an entry
    other = DiskCache(tmp_path, max_bytes=10**6)
    assert all((_read(other, i) == _item(i)).all() for i in range(9))
    assert cache.bytes_held() == disk_bytes(tmp_path) == 9 * (_entry_size() + ENTRY_OVERHEAD)


def test_an_index_that_takes_part_of_a_batch_keeps_what_its_whole_records_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk can take a batch's records in part (a reviewer's RLIMIT_FSIZE): the
    # entries of whole records stay, the rest is given back, and no file passes the
    # ledger (a torn record's room stays counted: its bytes are in the index).
    cache = DiskCache(tmp_path, max_bytes=10**6)
    _write(cache, 0)
    real = os.write

    def short(fd: int, data: Any) -> int:
        return real(fd, bytes(data)[: 2 * RECORD_BYTES + 12])

    monkeypatch.setattr(cache_store.os, "write", short)
    batch = [(i, encode_entry(_item(i), STAGE, i)) for i in range(1, 6)]
    assert cache.write_many(STAGE, batch) == 2 and cache.full
    monkeypatch.undo()
    assert disk_bytes(tmp_path) <= cache.bytes_held()
    other = DiskCache(tmp_path, max_bytes=10**6)  # a first use: the recount
    assert [_read(other, i) is not None for i in range(6)] == [True] * 3 + [False] * 3
    assert other.bytes_held() == disk_bytes(tmp_path)


def test_a_batch_past_the_cap_is_written_one_by_one_up_to_it(tmp_path: Path) -> None:
    cap = int(3.5 * (_entry_size() + ENTRY_OVERHEAD))
    cache = DiskCache(tmp_path, max_bytes=cap)
    batch = [(i, encode_entry(_item(i), STAGE, i)) for i in range(5)]
    assert cache.write_many(STAGE, batch) == 3 and cache.full
    assert [_read(cache, i) is not None for i in range(5)] == [True] * 3 + [False] * 2
    assert cache.bytes_held() == disk_bytes(tmp_path) <= cap
    assert cache.write_many(STAGE, batch[3:]) == 0  # full: nothing more, nothing rewritten


def test_a_torn_segment_tail_and_a_torn_index_tail_are_never_served(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    for i in range(4):
        _write(cache, i)
    last = cache.place(STAGE, 3)
    assert last is not None
    os.truncate(last.path, last.offset + last.length - 7)  # the last entry cut short
    with open(stage_dirs(tmp_path)[0] / INDEX_NAME, "ab") as f:
        f.write(pack_record(9, 1, 0, 100)[:30])  # a record torn by a crash
    fresh = DiskCache(tmp_path, max_bytes=10**6)
    assert _read(fresh, 3) is None  # short: absent, built again by the cache
    assert _read(fresh, 9) is None
    assert [(_read(fresh, i) == _item(i)).all() for i in range(3)] == [True] * 3


def test_a_corrupted_entry_is_rejected_and_its_rebuild_keeps_within_the_cap(
    tmp_path: Path,
) -> None:
    cap = 4 * (_entry_size() + ENTRY_OVERHEAD)
    stage = StageCache(DiskCache(tmp_path, max_bytes=cap), STAGE, "test", measure=False)
    for i in range(6):  # four fit
        assert (stage.get(i, lambda i=i: _item(i)) == _item(i)).all()
    assert stage.cache_stats.writes == 4 and disk_bytes(tmp_path) == cap
    place = entries(tmp_path)[(stage_dirs(tmp_path)[0].name, 2)]
    overwrite(place, b"\x00", at=place.length - 1)  # a corrupted pixel
    again = StageCache(DiskCache(tmp_path, max_bytes=cap), STAGE, "test", measure=False)
    assert (again.get(2, lambda: _item(2)) == _item(2)).all()  # rebuilt, never served
    assert again.cache_stats.rejected == 1 and again.cache_stats.writes == 0  # no room
    assert (again.get(2, lambda: _item(2)) == _item(2)).all()  # forgotten: not read again
    assert again.cache_stats.rejected == 1 and again.cache_stats.misses == 2
    assert disk_bytes(tmp_path) == cap == again.cache.bytes_held()  # the cap held
    # With room, a rebuilt entry is stored again, and the index's later record wins.
    roomy = StageCache(DiskCache(tmp_path, max_bytes=2 * cap), STAGE, "test", measure=False)
    roomy.get(2, lambda: _item(2))
    assert roomy.cache_stats.rejected == 1 and roomy.cache_stats.writes == 1
    last = StageCache(DiskCache(tmp_path, max_bytes=2 * cap), STAGE, "test", measure=False)
    assert (last.get(2, lambda: _item(2)) == _item(2)).all() and last.cache_stats.hits == 1


def test_an_entry_without_its_crc_is_refused() -> None:
    # Every entry is written with a crc: one whose crc key was damaged is not trusted.
    from batchq.errors import FrameError
    from batchq.wire.codec import FrameHeader, FrameKind, encode_frame_pieces

    header = FrameHeader(
        kind=FrameKind.BATCH, run=STAGE, epoch=0, shard=0, k=3, producer="cache",
        sources=["tree", "a0"],
    )  # fmt: skip
    bare = bytes(encode_frame_pieces(header, [["a", 0, None], _item(3)], checksum=False))
    with pytest.raises(FrameError) as e:
        decode_entry(bare, STAGE, 3)
    assert e.value.reason == "no_checksum"
    assert (decode_entry(bytes(encode_entry(_item(3), STAGE, 3)), STAGE, 3) == _item(3)).all()


def test_clear_and_the_ledger_leave_a_users_folder_alone(tmp_path: Path) -> None:
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "a.jpg").write_bytes(b"x" * 5000)
    (mine / ".tmp-123-x").write_bytes(b"y" * 10)  # named like an earlier layout's file
    cache = DiskCache(tmp_path, max_bytes=10**6)
    assert _write(cache, 0)
    assert cache.bytes_held() == disk_bytes(tmp_path) > 0  # the stage's files alone
    cache.clear()
    assert sorted(p.name for p in mine.iterdir()) == [".tmp-123-x", "a.jpg"]
    assert cache.bytes_held() == 0


def test_another_stages_entry_under_the_fingerprint_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two stages a fingerprint cannot tell apart (a transform's repr hiding its
    # parameter): the first entry a process reads is checked against a build.
    first = StageCache(DiskCache(tmp_path), STAGE, "test", measure=False)
    for i in range(3):
        first.get(i, lambda i=i: _item(i))
    again = StageCache(DiskCache(tmp_path), STAGE, "test", measure=False)
    assert (again.get(0, lambda: _item(0)) == _item(0)).all()  # the same stage: served
    assert again.cache_stats.hits == 1 and not again.bypassed
    other = StageCache(DiskCache(tmp_path), STAGE, "test", measure=False)
    with caplog.at_level(logging.WARNING, logger="producer.cache_stage"):
        for i in range(3):
            assert (other.get(i, lambda i=i: _item(i + 10)) == _item(i + 10)).all()
    assert other.bypassed and other.cache_stats.hits == 0 and other.cache_stats.misses == 3
    assert len(caplog.records) == 1 and "pass key=" in caplog.records[0].message  # once


def test_the_first_reads_check_passes_the_same_stage_whatever_its_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A size-1 axis's stride is arbitrary: the entry read back has another than the
    # item built (a CHW image made from HWC, then batched: permute, then unsqueeze).
    def image(i: int) -> np.ndarray[Any, Any]:
        return np.full((4, 5, 3), i, dtype=np.uint8).transpose(2, 0, 1)[None]

    first = StageCache(DiskCache(tmp_path), STAGE, "test", measure=False)
    first.get(0, lambda: image(0))
    now = [0.0]
    monkeypatch.setattr(cache_stage, "clock", lambda: now[0])

    def build() -> np.ndarray[Any, Any]:
        now[0] += 1.0  # a build takes 1 s on this clock, a read nothing
        return image(0)

    again = StageCache(DiskCache(tmp_path), STAGE, "test", measure=False)
    assert (again.get(0, build) == image(0)).all()
    assert again.cache_stats.hits == 1 and not again.bypassed
    assert again.cache_stats.saved_s == 1.0  # a warm process's saving, timed by the check


def test_a_function_holding_a_set_is_named_alike_in_every_process() -> None:
    code = (
        "from producer.cache_stage import describe\n"
        "def scale(x, names=frozenset({'red', 'green', 'blue', 'alpha'})):\n"
        "    return x\n"
        "print(describe(scale))"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(names) == 1 and "alpha" in names.pop()


def test_foreign_files_are_counted_never_read(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    _write(cache, 0)
    stage = stage_dirs(tmp_path)[0]
    (stage / "notes.txt").write_bytes(b"x" * 500)  # not a segment: counted, never read
    (stage / segment_name(0x1234)).write_bytes(b"not frames" * 50)  # no record names it
    with open(stage / INDEX_NAME, "ab") as f:  # a record naming a segment that is not there
        f.write(pack_record(5, 0x9999, 0, 100))
    earlier = [stage / "3.bqc", stage / ".tmp-4-host-1-70000"]  # the per-entry layout's
    for p in earlier:
        p.write_bytes(b"BQF an entry of the earlier layout")
    fresh = DiskCache(tmp_path, max_bytes=10**6)
    assert (_read(fresh, 0) == _item(0)).all()
    assert _read(fresh, 5) is None
    assert fresh.bytes_held() == disk_bytes(tmp_path)
    assert not any(p.exists() for p in earlier)  # nothing reads them: removed, not counted
    assert (stage / "notes.txt").exists()


def test_a_segment_at_the_records_largest_offset_is_followed_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_store, "MAX_FIELD", 2 * (_entry_size() + ENTRY_OVERHEAD))
    cache = DiskCache(tmp_path, max_bytes=10**6)
    assert all(_write(cache, i) for i in range(5))
    segments = [p for p in files(tmp_path) if p.name.startswith("seg-")]
    assert len(segments) == 3  # two entries each (the third would pass the limit)
    assert all((_read(DiskCache(tmp_path), i) == _item(i)).all() for i in range(5))
    assert cache.bytes_held() == disk_bytes(tmp_path)


def test_threads_of_one_process_share_its_segment(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**7)
    start = threading.Barrier(2, timeout=TIMEOUT_S)

    def write(first: int) -> None:
        start.wait()
        for i in range(first, first + PER_WRITER):
            assert _write(cache, i, 5000)

    threads = [threading.Thread(target=write, args=(k * PER_WRITER,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    reader = DiskCache(tmp_path)
    assert all((_read(reader, i) == _item(i, 5000)).all() for i in range(2 * PER_WRITER))
    assert cache.bytes_held() == disk_bytes(tmp_path)


# -- processes -----------------------------------------------------------------------


def _writer(directory: str, cap: int, first: int, go: Any, done: Any) -> None:
    cache = DiskCache(directory, max_bytes=cap)
    if not go.wait(TIMEOUT_S):
        os._exit(3)
    for i in range(first, first + PER_WRITER):
        _write(cache, i, 5000)
    done.set()
    os._exit(0)


@pytest.mark.parametrize("cap", [10**7, 150 * (5000 + 300)])
def test_two_writer_processes_share_a_directory_and_its_cap(tmp_path: Path, cap: int) -> None:
    go = _fork.Event()
    done = [_fork.Event(), _fork.Event()]
    procs = [
        _fork.Process(target=_writer, args=(str(tmp_path), cap, PER_WRITER * k, go, done[k]))
        for k in range(2)
    ]
    for p in procs:
        p.start()
    go.set()
    assert all(d.wait(TIMEOUT_S) for d in done)
    for p in procs:
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
    reader = DiskCache(tmp_path, max_bytes=cap)
    held = [i for i in range(2 * PER_WRITER) if _read(reader, i) is not None]
    assert all((_read(reader, i) == _item(i, 5000)).all() for i in held)
    assert reader.bytes_held() == disk_bytes(tmp_path) <= cap
    if cap == 10**7:
        assert held == list(range(2 * PER_WRITER))  # each process's entries, read by a third
        assert len([p for p in files(tmp_path) if p.name.startswith("seg-")]) == 2
    else:  # filled to within an entry per writer (one may have filled it alone)
        assert disk_bytes(tmp_path) > cap - 2 * (_entry_size(5000) + ENTRY_OVERHEAD)


def _killed_writer(directory: str, written: Any, batch: bool) -> None:
    cache = DiskCache(directory, max_bytes=10**7)
    for i in range(3):
        _write(cache, i)
    real = SegmentWriter.write_at

    def half_then_stop(self: SegmentWriter, offset: int, payload: Any) -> None:
        data = b"".join(bytes(b) for b in payload.buffers)
        os.pwrite(self.fd, data[: len(data) // 2], offset)  # killed in the middle
        written.set()
        signal.pause()

    SegmentWriter.write_at = half_then_stop  # type: ignore[method-assign]
    if batch:  # killed past entry 3's bytes, inside entry 4's: no record of either
        cache.write_many(STAGE, [(i, encode_entry(_item(i), STAGE, i)) for i in (3, 4, 5)])
    else:
        _write(cache, 3)
    SegmentWriter.write_at = real  # type: ignore[method-assign]
    os._exit(4)


@pytest.mark.parametrize("batch", [False, True])
def test_a_writer_killed_mid_entry_leaves_its_whole_entries_and_nothing_torn(
    tmp_path: Path, batch: bool
) -> None:
    written = _fork.Event()
    proc = _fork.Process(target=_killed_writer, args=(str(tmp_path), written, batch))
    proc.start()
    try:
        assert written.wait(TIMEOUT_S)
        assert len(entries(tmp_path)) == 3  # the fourth has no record
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT_S)
    (segment,) = [p for p in files(tmp_path) if p.name.startswith("seg-")]
    torn_size = segment.stat().st_size
    fresh = DiskCache(tmp_path, max_bytes=10**7)
    assert [(_read(fresh, i) == _item(i)).all() for i in range(3)] == [True] * 3
    assert _read(fresh, 3) is None and _read(fresh, 4) is None
    name = parse_segment_name(segment.name)
    assert name is not None
    sealed = stage_dirs(tmp_path)[0] / segment_name(name.token)
    assert not segment.exists() and sealed.stat().st_size == 3 * _entry_size() < torn_size
    assert fresh.bytes_held() == disk_bytes(tmp_path)
    assert _write(fresh, 3) and (_read(DiskCache(tmp_path), 3) == _item(3)).all()


def test_a_forked_copy_writes_a_segment_of_its_own(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    _write(cache, 0)  # the parent's segment open
    done = _fork.Event()
    proc = _fork.Process(target=_child_writes, args=(cache, done))
    proc.start()
    assert done.wait(TIMEOUT_S)
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 0
    _write(cache, 2)
    segments = [p for p in files(tmp_path) if p.name.startswith("seg-")]
    assert len(segments) == 2
    assert all((_read(DiskCache(tmp_path), i) == _item(i)).all() for i in range(3))


def _child_writes(cache: DiskCache, done: Any) -> None:
    code = 0 if _write(cache, 1) else 5
    done.set()
    os._exit(code)


def test_clear_removes_every_segment_and_a_writer_starts_a_new_one(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**6)
    _write(cache, 0)
    DiskCache(tmp_path).clear()
    assert files(tmp_path) == [] and _read(cache, 0) is None
    assert _write(cache, 1) and (_read(DiskCache(tmp_path), 1) == _item(1)).all()
    assert cache.bytes_held() == disk_bytes(tmp_path)


def test_a_process_that_filled_the_cap_writes_again_after_another_ones_clear(
    tmp_path: Path,
) -> None:
    cap = 3 * (_entry_size() + ENTRY_OVERHEAD)
    cache = DiskCache(tmp_path, max_bytes=cap)
    assert [_write(cache, i) for i in range(4)] == [True, True, True, False]
    assert cache.full
    DiskCache(tmp_path).clear()  # as another process's
    assert _read(cache, 0) is None  # the emptied directory seen: room again
    assert not cache.full and _write(cache, 4) and cache.bytes_held() == disk_bytes(tmp_path)


# -- threads of one process, records that lie, writers that look dead -----------------


def _pause_thread(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[Any, Any]:
    """SegmentWriter.write_at held in thread ``name`` (its entry reserved, nothing
    written) until the second event is set; the first says it got there."""
    paused, go = threading.Event(), threading.Event()
    real = SegmentWriter.write_at

    def held(self: SegmentWriter, offset: int, payload: Any) -> None:
        if threading.current_thread().name == name:
            paused.set()
            assert go.wait(TIMEOUT_S)
        real(self, offset, payload)

    monkeypatch.setattr(SegmentWriter, "write_at", held)
    return paused, go


def test_a_thread_writing_across_clear_never_writes_into_the_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**7)
    for i in range(5):
        assert _write(cache, i)
    paused, go = _pause_thread(monkeypatch, "T1")
    t1 = threading.Thread(target=_write, args=(cache, 5), name="T1")
    t1.start()
    try:
        assert paused.wait(TIMEOUT_S)  # T1 between its reservation and its record
        clearer = DiskCache(tmp_path)  # kept open: its descriptors' numbers stay taken
        clearer.clear()  # as another process's clear()
        assert _write(cache, 100)  # finds its segment removed: a new segment and index
    finally:
        go.set()
        t1.join(TIMEOUT_S)
    assert not t1.is_alive()
    # Neither T1's bytes nor its record went into the new files (the ledger still says
    # them), nor did it find its descriptors closed (and stop writing).
    assert cache.bytes_held() == disk_bytes(tmp_path)
    assert [i for _stage, i in entries(tmp_path)] == [100]
    assert _write(cache, 101)
    fresh = DiskCache(tmp_path, max_bytes=10**7)
    assert (_read(fresh, 100) == _item(100)).all()  # T1's bytes did not land on it
    assert _read(fresh, 5) is None  # written into the removed files, not the new ones
    assert fresh.bytes_held() == disk_bytes(tmp_path)


@pytest.mark.parametrize("length", [(1 << 40) - 1, 10**6])
def test_a_record_past_its_segments_end_reads_as_absent_without_allocating(
    tmp_path: Path, length: int
) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**7)
    assert _write(cache, 0)
    place = cache.place(STAGE, 0)
    assert place is not None
    name = parse_segment_name(os.path.basename(place.path))
    assert name is not None
    with open(stage_dirs(tmp_path)[0] / INDEX_NAME, "ab") as index:
        index.write(pack_record(1, name.token, 0, length))  # crc-valid, a lie
    reader = DiskCache(tmp_path, max_bytes=10**7)
    assert reader.read(STAGE, 1) is None  # no MemoryError, no 1 TiB bytearray
    assert (_read(reader, 0) == _item(0)).all()
    assert _write(reader, 1) and (_read(DiskCache(tmp_path), 1) == _item(1)).all()


def test_threads_reading_more_segments_than_a_reader_keeps_open(tmp_path: Path) -> None:
    n = 200
    for w in range(20):  # 20 writers, one segment each: more than a view keeps open
        writer = DiskCache(tmp_path, max_bytes=10**8)
        assert all(_write(writer, i, 2000 + i) for i in range(w, n, 20))
        writer.close()
    reader = DiskCache(tmp_path, max_bytes=10**8)
    start = threading.Barrier(4, timeout=TIMEOUT_S)
    wrong: list[tuple[int, str]] = []

    def read(seed: int) -> None:
        start.wait()
        for k in range(3000):
            i = (seed * 7919 + k * 104729) % n
            try:
                got = _read(reader, i)  # a FrameError: bytes of another segment read
            except BaseException as e:  # reported by the main thread
                wrong.append((i, repr(e)))
                continue
            if got is None or got.shape != (2000 + i,) or not (got == i % 251).all():
                wrong.append((i, "absent or wrong"))

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


def test_two_threads_missing_at_once_read_each_record_once(tmp_path: Path) -> None:
    writer = DiskCache(tmp_path, max_bytes=10**8)
    for i in range(2000):
        assert _write(writer, i, 10)
    index = stage_dirs(tmp_path)[0] / INDEX_NAME
    for _ in range(30):
        reader = DiskCache(tmp_path)
        start = threading.Barrier(2, timeout=TIMEOUT_S)

        def miss(r: DiskCache = reader, b: threading.Barrier = start) -> None:
            b.wait()
            assert r.read(STAGE, 10**9) is None  # absent: both read the index

        threads = [threading.Thread(target=miss) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert reader._views[STAGE[:32]]._read_to == index.stat().st_size


def test_threads_making_a_caches_first_use_at_once(tmp_path: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    failed: list[BaseException] = []
    for trial in range(40):
        cache = DiskCache(tmp_path, max_bytes=10**8)
        start = threading.Barrier(4, timeout=TIMEOUT_S)

        def write(i: int, c: DiskCache = cache, b: threading.Barrier = start) -> None:
            b.wait()
            try:
                assert _write(c, i, 100)
            except BaseException as e:
                failed.append(e)

        threads = [threading.Thread(target=write, args=(trial * 4 + k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        cache.close()
        del cache, threads
    assert failed == []
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing leaked
    assert len([p for p in files(tmp_path) if p.name.startswith("seg-")]) == 40


def _hold_segment(stage_dir: str, ready: Any, go: Any) -> None:
    # A writer in a process of its own (a recount skips this process's own tokens).
    writer = SegmentWriter(stage_dir, 0xBEEF, 2**22 + 1, cache_store.HOST)
    os.ftruncate(writer.fd, 5000)  # its reservation, no record yet
    ready.set()
    go.wait(TIMEOUT_S)


def test_a_live_writer_whose_pid_looks_dead_keeps_its_segment(tmp_path: Path) -> None:
    # The writer's name says a pid no process of this namespace has (a writer in another
    # pid namespace, on a host of the same name): only its lock says it runs.
    cache = DiskCache(tmp_path, max_bytes=10**7)
    assert _write(cache, 0)
    stage_dir = str(stage_dirs(tmp_path)[0])
    path = os.path.join(stage_dir, segment_name(0xBEEF, 2**22 + 1, cache_store.HOST))
    ready, go = _fork.Event(), _fork.Event()
    holder = _fork.Process(target=_hold_segment, args=(stage_dir, ready, go))
    holder.start()
    try:
        assert ready.wait(TIMEOUT_S)
        DiskCache(tmp_path).bytes_held()  # a first use here: a recount that must not seal it
        assert os.path.exists(path) and os.path.getsize(path) == 5000
    finally:
        go.set()
        holder.join(TIMEOUT_S)
    assert holder.exitcode == 0  # its writer gone: the next recount removes it (no record)
    fresh = DiskCache(tmp_path)
    assert fresh.bytes_held() == disk_bytes(tmp_path)
    # Neither its name nor the sealed one (a match on "beef" also met another writer's
    # random token that held it: one run in thousands).
    sealed = os.path.join(stage_dir, segment_name(0xBEEF))
    assert not os.path.exists(path) and not os.path.exists(sealed)


def test_a_reader_that_only_hits_lets_a_cleared_stage_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_store, "REMOVED_CHECK_S", 0.0, raising=False)
    writer = DiskCache(tmp_path, max_bytes=10**7)
    for i in range(3):
        assert _write(writer, i, 10**5)
    writer.close()
    reader = DiskCache(tmp_path, max_bytes=10**7)
    assert all(_read(reader, i) is not None for i in range(3))
    DiskCache(tmp_path).clear()
    assert [_read(reader, i) is None for i in range(3)] == [True] * 3  # not served after clear()
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".bqs (deleted)"):
                held.append(fd)
    assert held == []  # the removed segments' disk given back


def test_two_pending_reservations_each_keep_their_records_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**7)
    both, go = threading.Barrier(3, timeout=TIMEOUT_S), threading.Event()
    real = SegmentWriter.write_at

    def held(self: SegmentWriter, offset: int, payload: Any) -> None:
        both.wait()  # both reserved, neither written
        assert go.wait(TIMEOUT_S)
        real(self, offset, payload)

    monkeypatch.setattr(SegmentWriter, "write_at", held)
    threads = [threading.Thread(target=_write, args=(cache, i, 5000)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        both.wait()
        DiskCache(tmp_path).bytes_held()  # another process's first use: a recount now
    finally:
        go.set()
        for t in threads:
            t.join(TIMEOUT_S)
    assert cache.bytes_held() == disk_bytes(tmp_path)  # each record's room was counted
    assert [_read(cache, i) is not None for i in range(2)] == [True, True]


def test_a_failed_write_before_another_reservation_gives_back_only_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DiskCache(tmp_path, max_bytes=10**7)
    assert _write(cache, 0)
    paused, go = threading.Event(), threading.Event()
    real = SegmentWriter.write_at

    def fail_first(self: SegmentWriter, offset: int, payload: Any) -> None:
        if threading.current_thread().name == "failing":
            paused.set()
            assert go.wait(TIMEOUT_S)  # another thread reserves after it meanwhile
            raise OSError("disk refused")
        real(self, offset, payload)

    monkeypatch.setattr(SegmentWriter, "write_at", fail_first)
    failing = threading.Thread(target=_write, args=(cache, 1), name="failing")
    failing.start()
    try:
        assert paused.wait(TIMEOUT_S)
        later = threading.Thread(target=_write, args=(cache, 2))
        later.start()
        later.join(TIMEOUT_S)
    finally:
        go.set()
        failing.join(TIMEOUT_S)
    assert cache.full  # it stops writing, and its ledger still counts the disk
    assert int((tmp_path / ".bytes").read_bytes()) == disk_bytes(tmp_path)
    assert [_read(DiskCache(tmp_path), i) is not None for i in range(3)] == [True, False, True]


def _gc_inside_another_caches_lock(directory: str) -> None:
    gc.disable()
    held = DiskCache(directory, max_bytes=10**7)
    held.bytes_held()
    garbage = DiskCache(directory, max_bytes=10**7)
    garbage.bytes_held()
    garbage.cycle = garbage  # type: ignore[attr-defined]  # finalised by the cyclic GC only
    del garbage
    first = DiskCache(directory, max_bytes=10**7)  # not opened yet
    waiting = threading.Event()
    real = cache_store.fcntl.flock

    def flock(fd: int, op: int) -> None:
        if threading.current_thread().name == "first-use" and op == fcntl.LOCK_EX:
            waiting.set()  # _OPEN_LOCK held, the flock (held by "gc") waited for
        real(fd, op)

    cache_store.fcntl = types.SimpleNamespace(  # type: ignore[assignment]
        LOCK_EX=fcntl.LOCK_EX, LOCK_UN=fcntl.LOCK_UN, flock=flock
    )
    locked = threading.Event()

    def in_lock() -> None:
        with held._locked():
            locked.set()
            if waiting.wait(TIMEOUT_S):
                gc.collect()  # what any allocation may do: garbage's __del__ here

    threads = [
        threading.Thread(target=in_lock, name="gc", daemon=True),
        threading.Thread(target=first.bytes_held, name="first-use", daemon=True),
    ]
    threads[0].start()
    assert locked.wait(TIMEOUT_S)
    threads[1].start()
    for t in threads:
        t.join(TIMEOUT_S / 3)
    os._exit(1 if any(t.is_alive() for t in threads) else 0)


def test_a_cache_finalised_by_the_gc_inside_another_caches_lock_deadlocks_nothing(
    tmp_path: Path,
) -> None:
    # In a process of its own: a deadlock there holds _OPEN_LOCK for ever.
    proc = _fork.Process(target=_gc_inside_another_caches_lock, args=(str(tmp_path),))
    proc.start()
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT_S)
    assert proc.exitcode == 0  # 1: the threads deadlocked


_POSIX_FLOCK = types.SimpleNamespace(  # what NFS does with flock(): POSIX locks
    LOCK_SH=fcntl.LOCK_SH,
    LOCK_EX=fcntl.LOCK_EX,
    LOCK_NB=fcntl.LOCK_NB,
    LOCK_UN=fcntl.LOCK_UN,
    flock=lambda fd, op: fcntl.lockf(fd, op),
)


def _write_one(directory: str, i: int) -> None:
    os._exit(0 if _write(DiskCache(directory, max_bytes=10**8), i) else 1)


def _recount_once(directory: str) -> None:
    cache_segment._OWN_TOKENS.clear()  # as in a process of its own (a fork copies them)
    DiskCache(directory).bytes_held()
    os._exit(0)


def _run(target: Any, *args: Any) -> None:
    proc = _fork.Process(target=target, args=args)
    proc.start()
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 0


def test_on_posix_locks_reading_many_segments_keeps_the_writers_own_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS's flock is POSIX locks, dropped by the close of ANY descriptor of the file in
    # the process: the reader's LRU must never close one of this process's own segment.
    monkeypatch.setattr(cache_segment, "fcntl", _POSIX_FLOCK)
    for k in range(17):  # earlier producers' segments: more than a reader keeps open
        _run(_write_one, str(tmp_path), k)
    cache = DiskCache(tmp_path, max_bytes=10**8)
    assert _write(cache, 100)
    for i in [100, *range(17)]:  # its own segment read first: the oldest in the LRU
        assert (_read(cache, i) == _item(i)).all()
    reserved, go = threading.Event(), threading.Event()
    real = SegmentWriter.write_at

    def held(self: SegmentWriter, offset: int, payload: Any) -> None:
        reserved.set()
        assert go.wait(TIMEOUT_S)
        real(self, offset, payload)

    monkeypatch.setattr(SegmentWriter, "write_at", held)
    pending = threading.Thread(target=_write, args=(cache, 101, 10**5))
    pending.start()
    try:
        assert reserved.wait(TIMEOUT_S)
        _run(_recount_once, str(tmp_path))  # another process's first use: a recount
        own = cache._writers[STAGE[:32]]
        assert os.path.exists(own.path)  # not sealed under its writer
    finally:
        go.set()
        pending.join(TIMEOUT_S)
    assert cache.bytes_held() == disk_bytes(tmp_path)  # the reservation was not cut off
    assert (_read(DiskCache(tmp_path), 101) == _item(101, 10**5)).all()


def _writer_with_a_forked_helper(directory: str, ready: Any, go: Any) -> None:
    cache = DiskCache(directory, max_bytes=10**7)  # alive: its segment open and locked
    assert _write(cache, 0)
    if os.fork() == 0:  # a helper forked without exec, never using the cache
        ready.set()
        go.wait(TIMEOUT_S)
        os._exit(0)
    ready.wait(TIMEOUT_S)
    alive = os.path.exists(cache._writers[STAGE[:32]].path)
    os._exit(0 if alive else 1)  # the writer ends; its helper lives on


def test_a_forked_child_that_never_uses_the_cache_holds_no_lock_of_its_parent(
    tmp_path: Path,
) -> None:
    ready, go = _fork.Event(), _fork.Event()
    try:
        pid = os.fork()  # not a Process: its join would wait for the helper too (its pipe)
        if pid == 0:
            try:
                _writer_with_a_forked_helper(str(tmp_path), ready, go)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)  # it ends once its helper is ready (or TIMEOUT_S)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ready.is_set()
        DiskCache(tmp_path).bytes_held()  # a recount while the helper lives
        names = [p.name for p in files(tmp_path) if p.name.startswith("seg-")]
        assert len(names) == 1
        parsed = parse_segment_name(names[0])
        assert parsed is not None and parsed.pid is None  # sealed: its writer is gone
    finally:
        go.set()
    assert (_read(DiskCache(tmp_path), 0) == _item(0)).all()
