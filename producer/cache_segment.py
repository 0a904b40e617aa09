"""The on-disk format of a stage's entries: append-only segments and the index that finds them.

A stage's directory (:mod:`producer.cache_store`) holds:

* **Segments**, ``seg-<token>-<pid>-<host>.bqs`` while the process that appends to it may
  still run, ``seg-<token>.bqs`` once sealed (its writer gone, its tail trimmed).
  ``<token>`` is 16 hex digits drawn by the writer (:data:`TOKEN_DIGITS`). A segment is
  the entries' frames (:mod:`producer.cache_entry`) back to back, nothing else; only
  its writer appends to it, at offsets it reserved under the directory's lock, and holds
  ``flock(LOCK_SH)`` on it while it may (pid and host in the name are for people).
* **The index**, ``index.bqi``: fixed-size records (:data:`RECORD`, :data:`RECORD_BYTES`
  bytes each), appended (one ``write``, under the lock) only after the entry's bytes are
  written: magic ``BQI1``, the entry's index (u64), its segment's token (u64), its
  offset and length in the segment (u64 each), and the crc32 of those 36 bytes
  (little-endian). A later record of an index replaces an earlier one (an entry
  rebuilt after it was rejected).

A reader (:class:`StageIndex`) keeps the index in memory as a table index -> place,
read once and then only its new records (from where it stopped, on a miss), so a lookup
is a dict lookup and a hit an ``fstat`` and one ``preadv``. A record whose magic or crc
does not hold (a torn tail after a crash, a foreign file's bytes) is skipped, and the
next record found by its magic; a record naming a segment not there, or bytes the
segment does not have (checked before anything is allocated), reads as absent. What a
record points at is an entry frame whose crc, stage and index the cache checks
(:func:`producer.cache_entry.decode_entry`):
the index finds an entry, it never vouches for its bytes.

A recount (:func:`recount_stage`, a process's first use) counts a stage's files, and
seals a writer's segment that no process holds ``flock``ed: its writer is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from batchq.wire.frame import Pieces

__all__ = [
    "INDEX_NAME",
    "MAX_FIELD",
    "RECORD",
    "RECORD_BYTES",
    "TOKEN_DIGITS",
    "Place",
    "SegmentName",
    "SegmentWriter",
    "StageIndex",
    "entry_places",
    "index_ends",
    "index_records",
    "pack_record",
    "parse_segment_name",
    "recount_stage",
    "seal_segment",
    "segment_name",
    "writer_gone",
]

#: The index file of a stage's directory.
INDEX_NAME = "index.bqi"
_MAGIC = b"BQI1"
#: An index record: magic, entry index, segment token, offset, length, crc32 of the rest.
RECORD = struct.Struct("<4sQQQQI")
#: The bytes of one index record (what an entry costs beside its frame).
RECORD_BYTES = RECORD.size
_BODY = RECORD_BYTES - 4
_FIELD_BITS = 40  # an offset's and a length's bits in a record's checks and the table
#: Offsets and lengths above this are refused (a record from a foreign file).
MAX_FIELD = 1 << _FIELD_BITS
_FIELD_MASK = MAX_FIELD - 1
#: Hex digits of a segment's token.
TOKEN_DIGITS = 16
_SEGMENT = re.compile(
    r"seg-(?P<token>[0-9a-f]{16})(?:-(?P<pid>\d+)-(?P<host>[A-Za-z0-9_.]*))?\.bqs"
)
# The per-entry files of the layout before segments (``<index>.bqc``, ``.tmp-...``): no
# process of this version reads them, so a recount removes them (else a full cache of
# them would keep the cap reached for ever).
_EARLIER_LAYOUT = re.compile(r"\d+\.bqc|\.tmp-\d+-.*")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_CHUNK = 1 << 20  # index bytes read per pread
_OPEN_SEGMENTS = 16  # a reader's open segment files (the oldest closed beyond)


@dataclass(frozen=True)
class SegmentName:
    """What a segment's file name says.

    Attributes:
        token: the segment's token (its records name it).
        pid: its writer's pid; None once sealed.
        host: its writer's host; None once sealed.
    """

    token: int
    pid: int | None
    host: str | None


@dataclass(frozen=True)
class Place:
    """Where an entry's bytes are.

    Attributes:
        path: its segment's path.
        offset: its first byte in the segment.
        length: its frame's bytes.
    """

    path: str
    offset: int
    length: int


def segment_name(token: int, pid: int | None = None, host: str | None = None) -> str:
    """A segment's file name: a live writer's (``pid`` and ``host``) or sealed."""
    if pid is None or host is None:
        return f"seg-{token:0{TOKEN_DIGITS}x}.bqs"
    return f"seg-{token:0{TOKEN_DIGITS}x}-{pid}-{host}.bqs"


def parse_segment_name(name: str) -> SegmentName | None:
    """The parts of a segment's file name; None for any other name."""
    match = _SEGMENT.fullmatch(name)
    if match is None:
        return None
    pid = match["pid"]
    return SegmentName(
        int(match["token"], 16), int(pid) if pid is not None else None, match["host"]
    )


def pack_record(index: int, token: int, offset: int, length: int) -> bytes:
    """The index record of an entry: its bytes ``[offset, offset + length)`` of segment
    ``token``."""
    body = RECORD.pack(_MAGIC, index, token, offset, length, 0)[:_BODY]
    return body + zlib.crc32(body).to_bytes(4, "little")


def index_records(buf: bytes | bytearray) -> tuple[list[tuple[int, int, int, int]], int]:
    """The valid records at the start of ``buf`` as (index, token, offset, length), and
    how many bytes were consumed (a partial record at the end is left for later; bytes
    that are not a valid record are skipped up to the next magic)."""
    out: list[tuple[int, int, int, int]] = []
    pos, end = 0, len(buf)
    while end - pos >= RECORD_BYTES:
        magic, index, token, offset, length, crc = RECORD.unpack_from(buf, pos)
        if (
            magic == _MAGIC
            and crc == zlib.crc32(memoryview(buf)[pos : pos + _BODY])
            and 0 < length < MAX_FIELD
            and offset < MAX_FIELD
        ):
            out.append((index, token, offset, length))
            pos += RECORD_BYTES
            continue
        found = buf.find(_MAGIC, pos + 1)  # resynchronise on the next record
        pos = found if found >= 0 else max(pos + 1, end - len(_MAGIC) + 1)
    return out, pos


class SegmentWriter:
    """This process's segment of one stage: created on its first entry, appended to.

    The writer holds ``flock(LOCK_SH)`` on its segment for as long as its descriptor is
    open: a recount seals only a segment it can lock exclusively (:func:`writer_gone`),
    which no pid, host name or clock can fool. The descriptor is closed only when the
    object goes (``__del__``): a thread between its reservation and its record holds a
    reference, so the number is never reused under it (a ``close()`` from another thread
    would let a new segment or index get the same number, and the old thread's bytes
    land there). This process's views read its entries through this descriptor
    (:meth:`StageIndex.own`): no other descriptor of the segment is opened and closed in
    the process (on NFS, whose ``flock`` is POSIX locks, closing any descriptor of a file
    drops the process's lock on it). A forked child closes its inherited copy at once
    (:func:`_after_fork_in_child`): it holds no lock on its parent's segment.

    Args:
        directory: the stage's directory.
        token: the segment's token.
        pid: the writer's pid (in the name, for people reading the directory).
        host: the writer's host (likewise).

    Raises:
        OSError: the segment could not be made or locked.
    """

    def __init__(self, directory: str, token: int, pid: int, host: str) -> None:
        self.token = token
        self.path = os.path.join(directory, segment_name(token, pid, host))
        self.fd = -1  # __del__ of a writer whose open failed closes nothing
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        try:
            # Made and locked under the directory's lock: no recount sees it unlocked.
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd
        _OWN_TOKENS.add(token)
        _WRITERS.add(self)
        self.end = 0  # the entries' bytes reserved so far (holes included)
        # Reservations whose records are not yet in the index: the segment holds a
        # record's room for each after ``end`` (so a recount in between counts them).
        self.pending = 0

    def fit(self) -> None:
        """Size the segment to its entries and one record's room per pending reservation
        (called under the directory's lock; never cuts an entry's bytes: they end at
        ``end``).

        Raises:
            OSError: the disk refused.
        """
        os.ftruncate(self.fd, self.end + RECORD_BYTES * self.pending)

    def write_at(self, offset: int, payload: Pieces) -> None:
        """Write ``payload``'s buffers back to back at ``offset`` (``pwritev``: no copy).

        Raises:
            OSError: the disk refused.
        """
        views = [memoryview(b).cast("B") for b in payload.buffers]
        while views:
            done = os.pwritev(self.fd, views[:1024], offset)  # IOV_MAX
            if done <= 0:
                raise OSError(f"pwritev wrote {done} bytes")
            offset += done
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]

    def __del__(self) -> None:
        # Only close: an explicit LOCK_UN would drop the lock of a forked parent that
        # shares the open file (the lock goes with the last descriptor of it).
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            _OWN_TOKENS.discard(self.token)
            with contextlib.suppress(OSError):
                os.close(fd)


# This process's writers' tokens: on NFS, flock is emulated with POSIX locks, which
# never conflict within one process, so a recount must not take its own segments' lock
# as proof their writer is gone (nor open and close a descriptor of one: that would drop
# the writer's lock).
_OWN_TOKENS: set[int] = set()
# This process's live writers (a forked child closes its copies of their descriptors).
_WRITERS: weakref.WeakSet[SegmentWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child's copies of its parent's segment descriptors closed (``fd`` -1):
    their shared ``flock`` is the open file's, so a child that never uses the cache would
    keep a dead parent's segment unsealed until it exits. Closing the child's copy leaves
    the parent's lock (its own descriptor) as it is; the child's first write makes a
    segment of its own. No other thread runs in the child: nothing uses them."""
    for writer in list(_WRITERS):
        fd, writer.fd = writer.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    _WRITERS.clear()
    _OWN_TOKENS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def writer_gone(path: str, token: int) -> int | None:
    """A descriptor of segment ``path`` locked exclusively when its writer is gone (no
    process holds its shared lock, whatever pid namespace or host it runs in), else None
    (the caller closes it; the lock goes with it)."""
    if token in _OWN_TOKENS:
        return None
    try:
        fd = os.open(path, os.O_RDWR | _CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a writer holds it
        os.close(fd)
        return None
    return fd


def _pack_place(number: int, offset: int, length: int) -> int:
    return (number << _FIELD_BITS | offset) << _FIELD_BITS | length


def _unpack_place(packed: int) -> tuple[int, int, int]:
    """(segment number, offset, length) of a packed table row."""
    return (
        packed >> (2 * _FIELD_BITS),
        (packed >> _FIELD_BITS) & _FIELD_MASK,
        packed & _FIELD_MASK,
    )


class StageIndex:
    """One process's view of a stage's index: index -> place, kept up to date on misses.

    Memory: one table row per entry in the index (a packed int: about 120 bytes,
    against an entry's tens to hundreds of KB), never an entry's bytes.

    Thread-safe: one lock covers the table, the read position and the open segments (a
    segment's descriptor closed by the LRU while another thread ``preadv``s on it
    rejected valid entries; two refreshes at once skipped records). The view's
    descriptors are closed only when it goes (``__del__``) or by :meth:`close`, which
    only a view no other thread uses may call.

    A segment this process writes is never in the LRU: read through its writer's
    descriptor (:meth:`own`), or, for a writer of another cache object of the process,
    through a descriptor kept until the view closes (on NFS, closing any descriptor of a
    file drops the process's POSIX lock on it, and with it the writer's ``flock``).

    Args:
        directory: the stage's directory (made if absent).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.fd = -1  # __del__ of a view whose open failed closes nothing
        os.makedirs(directory, exist_ok=True)
        self.index_path = os.path.join(directory, INDEX_NAME)
        self.fd = os.open(self.index_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | _CLOEXEC, 0o644)
        self._lock = threading.Lock()
        self._read_to = 0  # the index's bytes consumed
        self._table: dict[int, int] = {}  # index -> _pack_place(segment number, offset, length)
        self._tokens: list[int] = []  # segment number -> token
        self._numbers: dict[int, int] = {}  # token -> segment number
        self._names: dict[int, str] = {}  # token -> its file's current name
        self._open: OrderedDict[int, int] = OrderedDict()  # token -> descriptor (the LRU)
        self._own: dict[int, SegmentWriter] = {}  # token -> this process's writer of it
        self._kept: dict[int, int] = {}  # token -> descriptor of a segment the process writes

    def own(self, writer: SegmentWriter) -> None:
        """Read ``writer``'s entries through its descriptor (kept open while the view
        holds it: the view keeps the writer)."""
        with self._lock:
            self._own[writer.token] = writer

    def __len__(self) -> int:
        return len(self._table)

    def indices(self) -> list[int]:
        """The indices the view holds, sorted."""
        with self._lock:
            return sorted(self._table)

    def removed(self) -> bool:
        """The index file is no longer in the directory (``clear()`` removed it)."""
        return os.fstat(self.fd).st_nlink == 0

    def add(self, index: int, token: int, offset: int, length: int) -> None:
        """Record an entry's place (this process's own write, or a record read)."""
        with self._lock:
            self._add(index, token, offset, length)

    def forget(self, index: int) -> None:
        """Drop an entry from this view (it was rejected; a later record brings it back)."""
        with self._lock:
            self._table.pop(index, None)

    def refresh(self) -> None:
        """Read the records appended since the last look."""
        with self._lock:
            self._refresh()

    def place(self, index: int, refresh: bool = True) -> Place | None:
        """Where entry ``index`` is (the index read again on a miss), None if absent."""
        with self._lock:
            found = self._find(index, refresh)
            if found is None:
                return None
            token, offset, length = found
            name = self._names.get(token) or self._rescan(token)
        if name is None:
            return None
        return Place(os.path.join(self.directory, name), offset, length)

    def read(self, index: int, max_length: int = MAX_FIELD) -> bytearray | None:
        """Entry ``index``'s bytes as its record says (unchecked: the caller decodes
        them), None if absent, short, longer than ``max_length`` or past its segment's
        end (a crc-valid record with a huge length, a foreign file's, must not allocate
        its length before anything checked it)."""
        with self._lock:
            found = self._find(index, True)
            if found is None:
                return None
            token, offset, length = found
            if length > max_length:
                return None
            for _ in range(2):  # a segment sealed (renamed) since: its name looked up again
                fd = self._segment_fd(token)
                if fd is None:
                    return None
                try:
                    if os.fstat(fd).st_size < offset + length:
                        return None
                    buf = bytearray(length)
                    return buf if os.preadv(fd, [buf], offset) == length else None
                except OSError:
                    if token not in self._open:  # this process's segment: never closed
                        return None
                    self._drop_fd(token)
        return None

    def close(self) -> None:
        """Close the index's and the segments' files (only when no other thread uses
        the view: else let it go, and ``__del__`` closes them)."""
        with self._lock:
            for token in list(self._open):
                self._drop_fd(token)
            kept = list(self._kept.values())
            self._kept.clear()
            self._own.clear()  # the writer closes its descriptor when it goes
            fd, self.fd = self.fd, -1
        for kept_fd in kept:
            with contextlib.suppress(OSError):
                os.close(kept_fd)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is not None:
            # At interpreter exit the module's globals (contextlib, os) may be gone already,
            # suppress with them: the files close with the process.
            try:  # noqa: SIM105
                self.close()
            except (AttributeError, TypeError):
                pass

    # -- called with the lock held --------------------------------------------------------

    def _add(self, index: int, token: int, offset: int, length: int) -> None:
        number = self._numbers.get(token)
        if number is None:
            number = self._numbers[token] = len(self._tokens)
            self._tokens.append(token)
        self._table[index] = _pack_place(number, offset, length)

    def _find(self, index: int, refresh: bool) -> tuple[int, int, int] | None:
        """(token, offset, length) of entry ``index`` (the index read again on a miss)."""
        packed = self._table.get(index)
        if packed is None and refresh:
            self._refresh()
            packed = self._table.get(index)
        if packed is None:
            return None
        number, offset, length = _unpack_place(packed)
        return self._tokens[number], offset, length

    def _refresh(self) -> None:
        # Only the bytes the index has now (not a chunk's worth on every miss).
        size = os.fstat(self.fd).st_size
        while size - self._read_to >= RECORD_BYTES:
            raw = os.pread(self.fd, min(_READ_CHUNK, size - self._read_to), self._read_to)
            if len(raw) < RECORD_BYTES:
                return
            records, used = index_records(raw)
            for index, token, offset, length in records:
                self._add(index, token, offset, length)
            self._read_to += used

    def _segment_fd(self, token: int) -> int | None:
        writer = self._own.get(token)
        if writer is not None and writer.fd >= 0:
            return writer.fd
        fd = self._open.get(token)
        if fd is not None:
            self._open.move_to_end(token)
            return fd
        fd = self._kept.get(token)
        if fd is not None:
            return fd
        for _ in range(2):
            name = self._names.get(token) or self._rescan(token)
            if name is None:
                return None
            try:
                fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | _CLOEXEC)
            except FileNotFoundError:
                self._names.pop(token, None)  # renamed: look again
                continue
            if token in _OWN_TOKENS:  # another cache object's writer: never closed before
                self._kept[token] = fd  # the view (its writer's lock goes with a close)
                return fd
            self._open[token] = fd
            if len(self._open) > _OPEN_SEGMENTS:
                self._drop_fd(next(iter(self._open)))
            return fd
        return None

    def _drop_fd(self, token: int) -> None:
        fd = self._open.pop(token, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _rescan(self, token: int) -> str | None:
        """The segments' names read from the directory again; ``token``'s, if there."""
        self._names = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                parsed = parse_segment_name(entry.name)
                if parsed is not None:
                    self._names[parsed.token] = entry.name
        return self._names.get(token)


def index_ends(directory: str) -> dict[int, int]:
    """Each segment's end as the stage's index says (the end of its last entry), by token
    (the index read a chunk at a time: memory bounded whatever its size)."""
    ends: dict[int, int] = {}
    try:
        fd = os.open(os.path.join(directory, INDEX_NAME), os.O_RDONLY | _CLOEXEC)
    except FileNotFoundError:
        return ends
    try:
        at = 0
        while len(raw := os.pread(fd, _READ_CHUNK, at)) >= RECORD_BYTES:
            records, used = index_records(raw)
            for _index, token, offset, length in records:
                ends[token] = max(ends.get(token, 0), offset + length)
            at += used
    finally:
        os.close(fd)
    return ends


def entry_places(directory: str) -> dict[int, Place]:
    """Every entry of a stage's directory and its place (the latest record of each index)."""
    view = StageIndex(directory)
    try:
        view.refresh()
        out = {}
        for index in view.indices():
            place = view.place(index, refresh=False)
            if place is not None:
                out[index] = place
        return out
    finally:
        view.close()


def seal_segment(path: str, fd: int, token: int, end: int) -> int:
    """A dead writer's segment (``fd``: its descriptor, locked by :func:`writer_gone`) cut
    to ``end`` (the end of its indexed entries) and renamed sealed, or removed when
    nothing in it is indexed (``end`` 0); the bytes it keeps."""
    try:
        if end == 0:
            os.unlink(path)
            return 0
        if os.fstat(fd).st_size > end:
            os.ftruncate(fd, end)
        os.replace(path, os.path.join(os.path.dirname(path), segment_name(token)))
    except FileNotFoundError:
        return 0
    return end


def recount_stage(directory: str) -> int:
    """The bytes of a stage's files (called under the directory's lock): a writer's
    segment whose shared lock no process holds is cut to its indexed end and sealed
    (:func:`writer_gone`, :func:`seal_segment`); the earlier layout's files are removed."""
    total = 0
    dead: list[tuple[str, int, int]] = []  # (path, its locked descriptor, token)
    try:
        for entry in os.scandir(directory):
            with contextlib.suppress(FileNotFoundError):
                if not entry.is_file(follow_symlinks=False):
                    continue
                if _EARLIER_LAYOUT.fullmatch(entry.name):
                    os.unlink(entry.path)
                    continue
                parsed = parse_segment_name(entry.name)
                # A writer's segment whose lock no process holds: its writer is gone
                # (exact across pid namespaces, pid reuse, hosts and clocks).
                if parsed is not None and parsed.pid is not None:
                    fd = writer_gone(entry.path, parsed.token)
                    if fd is not None:
                        dead.append((entry.path, fd, parsed.token))
                        continue
                total += entry.stat(follow_symlinks=False).st_size
        if dead:
            ends = index_ends(directory)
            for path, fd, token in dead:
                total += seal_segment(path, fd, token, ends.get(token, 0))
    finally:
        for _path, fd, _token in dead:
            os.close(fd)
    return total
