"""Where cache entries live: a directory with a byte cap, shared by the processes of a host.

Layout: ``<directory>/<stage>/``, ``<stage>`` the first 32 hex digits of the stage's
fingerprint (a changed dataset or transform gets a directory of its own; the old one is
never read again, and stays until removed: :meth:`DiskCache.clear`), holding the stage's
segments and its index (:mod:`producer.cache_segment`: each process appends its entries,
frames of :mod:`producer.cache_entry`, to a segment of its own; a record in the shared
index says where each is). Beside the stages, ``.lock`` (``flock``ed around every change
of the ledger and every index append) and ``.bytes`` (the ledger: the bytes of every
segment and index, reservations included).

* **Atomic.** A writer reserves its entry's bytes at the end of its own segment (under
  the lock: the ledger, then the segment extended to them and to its index record's
  bytes), writes them without the lock (``pwritev``: nothing copied), and only then
  appends the entry's index record (one ``write``, under the lock, which also cuts the
  record's room off the segment: its bytes have moved to the index; the segment keeps a
  room for each other pending reservation of the process's threads). A
  process killed while writing leaves bytes no record points at, which a recount trims;
  a reader only follows records, and checks each entry's crc, stage and index
  (:func:`producer.cache_entry.decode_entry`).
* **Capped, across processes.** The reservation adds the entry's bytes and its index
  record's to the ledger only if that stays within ``max_bytes`` (else the process
  writes nothing more: the cache keeps what it has, a stable part, and never evicts),
  and extends the segment to them before any byte is written. So at any moment the
  files add up to at most the ledger, and the ledger to at most the cap. An entry
  rejected on read is forgotten, not removed (its bytes stay counted; one rebuilt is
  stored only if it fits).
* **Reconciled.** A process's first use takes the lock and recounts the ledger: every
  file's size (a live writer's reservations are in its segment's size; the per-entry
  files of the earlier layout are removed: nothing reads them now); a writer's segment
  whose shared ``flock`` no process holds (:func:`producer.cache_segment.writer_gone`)
  is trimmed to the end of its last indexed entry (removed when it has none) and sealed
  (renamed without its writer's name).
* **Threads.** A segment or view let go (``clear()``, a full segment) is forgotten,
  never closed: its descriptors close when the last thread using it lets go, so no new
  file can take their numbers under a thread still writing. A reader that only hits
  looks for ``clear()`` every :data:`REMOVED_CHECK_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batchq.errors import ConfigError
from batchq.wire.frame import Pieces
from producer.cache_segment import (
    MAX_FIELD,
    RECORD_BYTES,
    Place,
    SegmentWriter,
    StageIndex,
    pack_record,
    recount_stage,
)

__all__ = [
    "ENTRY_OVERHEAD",
    "HOST",
    "REMOVED_CHECK_S",
    "DiskCache",
    "default_directory",
    "stage_key",
]

log = logging.getLogger(__name__)

_LOCK = ".lock"
_LEDGER = ".bytes"
#: This host's name as segments' names carry it (for people: liveness is the segment's lock).
HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())
#: A reader that only hits looks whether ``clear()`` removed its stage this often (seconds):
#: else it would keep removed segments open, and serve them, for ever.
REMOVED_CHECK_S = 1.0
#: The bytes an entry costs beside its frame (its index record).
ENTRY_OVERHEAD = RECORD_BYTES
_STAGE_DIGITS = 32
#: A stage's directory: the first digits of its fingerprint. Nothing else in the cache's
#: directory is the cache's to count or remove (a user's folder kept there).
_STAGE_DIR = re.compile(f"[0-9a-f]{{{_STAGE_DIGITS}}}")

# Serialises a DiskCache's first use in a process (two threads making it at once raised
# ConfigError and leaked descriptors); module-wide, so a fork can make it anew in the
# child (a lock held by another thread at the fork would never be released there).
_OPEN_LOCK = threading.RLock()


def _new_open_lock() -> None:
    global _OPEN_LOCK
    _OPEN_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_open_lock)


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/batchq`` (``~/.cache/batchq``): one directory per host."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchq"


class DiskCache:
    """A directory of cache entries with a byte cap, safe for several processes at once.

    Args:
        directory: where entries live (default :func:`default_directory`); a directory
            on a shared file system with working ``flock`` serves many hosts. On NFS
            (``flock`` emulated by POSIX locks held by the server) what holds is: a
            writer's segment is not sealed by another host's recount while the writer's
            host keeps its locks (its lease; this process never closes a descriptor of a
            segment it writes, which would drop its lock); and ``clear()`` is seen by no
            process using the directory (a removed open file is renamed there, its
            ``st_nlink`` stays 1, so the writer's and the once-a-second reader's checks
            never fire): call it with no producer running.
        max_bytes: the cap on the bytes in ``directory`` (every stage's segments and
            indexes); None: half of the file system's free space and the bytes held,
            when the process first writes.
        key: names the cached stage in the fingerprint instead of what
            :func:`producer.torch.cache.cached` derives from the dataset (use it when
            the stage's code can change without its class, length or reprs changing).

    Raises:
        ConfigError: ``max_bytes`` or ``key`` is not valid.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        max_bytes: int | None = None,
        key: str | None = None,
    ) -> None:
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0
        ):
            raise ConfigError(f"max_bytes={max_bytes!r} is not valid: expected an int > 0 or None")
        self.key = None if key is None else _checked_key(key)
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes
        self._root = os.fspath(self.directory)  # paths as str: pathlib's cost ~20 us an entry
        self.full = False  # this process found the cap reached: it writes no more
        self.held_bytes = 0  # the ledger as this process last saw it
        self._process_state()

    def _process_state(self) -> None:
        self._pid: int | None = None  # the process that reconciled (a fork must again)
        self._fds: tuple[int, int] | None = None  # that process's lock and ledger files
        self._views: dict[str, StageIndex] = {}  # stage -> its index as this process reads it
        self._writers: dict[str, SegmentWriter] = {}  # stage -> this process's segment
        self._thread_lock = threading.Lock()  # flock does not exclude this process's threads
        self._checked: dict[str, float] = {}  # stage -> when a hit last looked for clear()
        self._unusable = False  # this process cannot open the directory (_opened)

    # -- what the cached dataset calls --------------------------------------------------

    def read(self, stage: str, index: int) -> bytearray | None:
        """The bytes of entry ``index`` of ``stage`` (a fingerprint), None if absent
        (unchecked: :func:`producer.cache_entry.decode_entry` checks them)."""
        if not self._opened():
            return None
        limit = self.max_bytes or MAX_FIELD  # no entry is longer than the cap
        try:
            view = self._view(stage)
            buf = view.read(index, limit)
            if (buf is None or self._check_due(stage)) and view.removed():
                # The directory cleared: read it afresh (the old view's files are closed
                # once no thread uses them: its segments' disk goes back).
                with self._thread_lock:
                    if self._views.get(stage[:_STAGE_DIGITS]) is view:
                        self._drop(stage)
                self.full = False  # emptied: room again for a process that had filled it
                buf = self._view(stage).read(index, limit)
        except OSError as e:
            log.debug("cache entry %s/%d unreadable: %s", stage[:16], index, e)
            return None
        return buf

    def write(self, stage: str, index: int, payload: Pieces) -> bool:
        """Store an entry (its buffers, written back to back) atomically if it fits under
        the cap; False when it does not (then this process writes no more) or the disk
        refused."""
        return self.write_many(stage, [(index, payload)]) == 1

    def write_many(self, stage: str, entries: Sequence[tuple[int, Pieces]]) -> int:
        """Store entries (index, buffers) as :meth:`write` does, each atomic, with one
        reservation, one write and one index append for all (a batch's: the lock's
        rounds were a third of an entry's write); where they do not all fit under the
        cap, one at a time until one does not. Returns how many were stored (the first
        ones)."""
        if self.full or not self._opened():
            return 0
        sizes = [payload.nbytes for _, payload in entries]
        if not entries or sum(sizes) + RECORD_BYTES * len(sizes) >= MAX_FIELD:
            # No index record could say where (one alone may still fit).
            return 0 if len(entries) < 2 else self._one_by_one(stage, entries)
        reserved = self._reserve(stage, sizes)
        if reserved is None:
            return 0 if len(entries) < 2 or self.full else self._one_by_one(stage, entries)
        writer, view, offset = reserved
        places = [offset + sum(sizes[:i]) for i in range(len(sizes))]
        try:
            # Outside the lock: the other writers go on.
            writer.write_at(offset, Pieces([b for _, p in entries for b in p.buffers], sum(sizes)))
        except OSError as e:
            self._give_back(writer, offset, sum(sizes), len(entries))
            return self._failed(e, 0)
        records = b"".join(
            pack_record(index, writer.token, at, size)
            for (index, _), at, size in zip(entries, places, sizes, strict=True)
        )
        indexed, error = self._index(writer, view, records, places, sizes)
        for (index, _), at, size in zip(entries[:indexed], places, sizes, strict=False):
            view.add(index, writer.token, at, size)
        return indexed if error is None else self._failed(error, indexed)

    def _index(
        self,
        writer: SegmentWriter,
        view: StageIndex,
        records: bytes,
        places: list[int],
        sizes: list[int],
    ) -> tuple[int, OSError | None]:
        """Under the lock: move the entries' records into the index; (how many records
        it took whole, the error where not all). Their rooms leave the segment first
        (files never pass the ledger, even for a writer killed between the two); where
        the index took only some (a full disk), the rest's rooms and the bytes of the
        entries no whole record names (where nothing was reserved after them) are given
        back, a torn record's room staying counted (its bytes are in the index)."""
        count = len(sizes)
        with self._locked() as fd:
            writer.pending -= count
            try:
                writer.fit()
                wrote, error = os.write(view.fd, records), None
            except OSError as e:
                wrote, error = 0, e
            whole, rooms = wrote // RECORD_BYTES, -(-wrote // RECORD_BYTES)
            if whole < count:
                error = error or OSError(f"index records of entries at {places[0]} written short")
                self._return(fd, writer, places[whole], sum(sizes[whole:]), count - rooms)
        return whole, error

    def _failed(self, error: OSError, written: int) -> int:
        """A write the disk refused: no more entries are written by this process."""
        self.full = True
        log.warning(
            "cache %s: writing failed (%s): no more entries are written", self.directory, error
        )
        return written

    def _one_by_one(self, stage: str, entries: Sequence[tuple[int, Pieces]]) -> int:
        """:meth:`write_many`'s entries written one at a time until one is not."""
        written = 0
        for entry in entries:
            if self.write_many(stage, [entry]) == 0:
                break
            written += 1
        return written

    def _check_due(self, stage: str) -> bool:
        """A hit's turn to look for ``clear()`` (at most every :data:`REMOVED_CHECK_S`)."""
        key, now = stage[:_STAGE_DIGITS], time.monotonic()
        if now - self._checked.get(key, -REMOVED_CHECK_S) < REMOVED_CHECK_S:
            return False
        self._checked[key] = now
        return True

    def _reserve(
        self, stage: str, sizes: list[int]
    ) -> tuple[SegmentWriter, StageIndex, int] | None:
        """Under the lock: add the entries' bytes and their records' to the ledger if that
        stays within the cap, and extend this process's segment to them; (the segment,
        the stage's index, the first entry's offset), or None where the cap (several
        entries: ``full`` stays unset, one may fit) or the disk refused."""
        size, count = sum(sizes), len(sizes)
        need = size + RECORD_BYTES * count
        with self._locked() as fd:
            used = _read_ledger(fd, self.directory)
            if used + need > self._cap() and count > 1:
                return None
            if used + need > self._cap():
                self.full = True
                log.info(
                    "cache %s: %d bytes held, the cap is %d: no more entries are written",
                    self.directory,
                    used,
                    self._cap(),
                )
                return None
            self.held_bytes = used + need
            _write_ledger(fd, used + need)  # first: the ledger never counts less than disk
            try:
                writer, view = self._writer(stage, size, count)
                offset = writer.end
                # The segment holds the reservation, and room for each record to come
                # (given back once it is in the index): a recount counts both, each
                # pending reservation's room once.
                writer.end, writer.pending = offset + size, writer.pending + count
                try:
                    writer.fit()
                except OSError:
                    writer.end, writer.pending = offset, writer.pending - count
                    raise
            except OSError as e:
                self.held_bytes = used
                _write_ledger(fd, used)
                self.full = True
                log.warning("cache %s: no entry can be made (%s)", self.directory, e)
                return None
        return writer, view, offset

    def _give_back(self, writer: SegmentWriter, offset: int, size: int, count: int) -> None:
        """A failed write's reservation (``count`` entries) given back: its records' room
        always; its entries' bytes only when nothing was reserved after them (else they
        stay in the segment, and counted: the ledger never says less than the disk)."""
        with self._locked() as fd:
            writer.pending -= count
            self._return(fd, writer, offset, size, count)

    def _return(self, fd: int, writer: SegmentWriter, offset: int, size: int, rooms: int) -> None:
        """Under the lock: ``rooms`` records' rooms (out of the segment's pending ones
        already) off the ledger, and the ``size`` bytes from ``offset`` where nothing
        was reserved after them (the segment cut to them)."""
        freed = RECORD_BYTES * rooms
        if writer.end == offset + size:
            writer.end = offset
            freed += size
        try:
            writer.fit()
        except OSError:  # the segment keeps its size: so does the ledger
            return
        self.held_bytes = max(0, _read_ledger(fd, self.directory) - freed)
        _write_ledger(fd, self.held_bytes)

    def discard(self, stage: str, index: int) -> None:
        """Forget a rejected entry in this process (its bytes stay counted until the
        directory is cleared): built again, it is stored again if it fits."""
        self._open()
        view = self._views.get(stage[:_STAGE_DIGITS])
        if view is not None:
            view.forget(index)

    def place(self, stage: str, index: int) -> Place | None:
        """Where entry ``index`` of ``stage`` is on disk (its segment, offset, length),
        None if the index has no record of it."""
        self._open()
        return self._view(stage).place(index)

    def bytes_held(self) -> int:
        """The ledger: the bytes of every segment and index in the directory (all stages)."""
        if not self._opened():
            return self.held_bytes
        with self._locked() as fd:
            self.held_bytes = _read_ledger(fd, self.directory)
        return self.held_bytes

    def clear(self) -> None:
        """Remove every entry of every stage (under the lock; the ledger goes to 0)."""
        self._open()
        with self._locked() as fd:
            for stage in list(self._views) + list(self._writers):
                self._drop(stage)
            for child in self.directory.iterdir():
                if child.is_dir() and _STAGE_DIR.fullmatch(child.name):
                    shutil.rmtree(child, ignore_errors=True)
            self.held_bytes = _recount(self.directory)
            _write_ledger(fd, self.held_bytes)
        self.full = False

    def close(self) -> None:
        """Close this process's files (a later use opens them again; the segments' and
        indexes' once no thread uses them)."""
        with _OPEN_LOCK, self._thread_lock:
            self._close_files()

    def _close_files(self) -> None:
        for stage in list(self._views) + list(self._writers):
            self._drop(stage)
        fds, self._fds, self._pid = self._fds, None, None
        if fds is not None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:
        # No lock: nothing else uses an object being finalised, and the cyclic GC may run
        # this in any thread, one holding the directory's flock inside another cache's
        # _locked() while a third waits for that flock holding _OPEN_LOCK (a deadlock).
        # At interpreter exit the module's globals (os, contextlib) may be gone already:
        # the files close with the process.
        try:
            if getattr(self, "_pid", None) == os.getpid():  # a forked copy's are its parent's
                self._close_files()
        except (AttributeError, TypeError):
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_pid", "_fds", "_views", "_writers", "_thread_lock"):
            state.pop(name, None)  # a copy in another process reconciles on its first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._process_state()

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r}, max_bytes={self.max_bytes}, key={self.key!r})"

    # -- internals ----------------------------------------------------------------------

    def _view(self, stage: str) -> StageIndex:
        key = stage[:_STAGE_DIGITS]
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = StageIndex(f"{self._root}/{key}")
        return view

    def _writer(self, stage: str, size: int, count: int) -> tuple[SegmentWriter, StageIndex]:
        """This process's segment of ``stage`` with room for ``size`` more bytes of
        ``count`` entries (made on
        its first entry; made again when the directory was cleared since, or the segment
        would pass an index record's largest offset) and the stage's index (called under
        the lock)."""
        key = stage[:_STAGE_DIGITS]
        writer = self._writers.get(key)
        if writer is not None and os.fstat(writer.fd).st_nlink == 0:
            self._drop(key)
            writer = None
        if (
            writer is not None
            and writer.end + size + RECORD_BYTES * (writer.pending + count) >= MAX_FIELD
        ):
            del self._writers[key]  # full: sealed once no thread holds it (its lock goes)
            writer = None
        view = self._view(key)
        if writer is None and view.removed():  # a view from before clear(): a new one
            self._drop(key)
            view = self._view(key)
        if writer is None:
            token = secrets.randbits(64)
            writer = self._writers[key] = SegmentWriter(view.directory, token, os.getpid(), HOST)
            view.own(writer)  # its entries read through its descriptor (never closed early)
        return writer, view

    def _drop(self, stage: str) -> None:
        """Forget the stage's view and segment (called under the thread lock). Never close
        them: a thread between its reservation and its record still uses them, and a
        closed number reused by the next segment or index would take its bytes; their
        files close when the last thread lets them go."""
        key = stage[:_STAGE_DIGITS]
        self._views.pop(key, None)
        self._writers.pop(key, None)
        self._checked.pop(key, None)

    def _cap(self) -> int:
        if self.max_bytes is None:
            usage = shutil.disk_usage(self.directory)
            # Half of what is free and held: the same figure in every process.
            self.max_bytes = (usage.free + self.held_bytes) // 2
            log.info(
                "cache %s: max_bytes not given, half the free space: %d",
                self.directory,
                self.max_bytes,
            )
        return self.max_bytes

    def _opened(self) -> bool:
        """Whether this process has the directory open (opening it first); False, said
        once, where it cannot (a read-only file system, no permission): the stage is
        then built, never read or written."""
        if self._unusable:
            return False
        try:
            self._open()
        except OSError as e:
            log.warning("cache %s cannot be used here (%s): items are built", self.directory, e)
            self._unusable = True  # in this process: nothing is read or written
            return False
        return True

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        with _OPEN_LOCK:  # one thread opens; the others find it done
            if self._pid == os.getpid():
                return
            # A forked copy: the parent's files and segments are not its. Built in locals
            # and published only once whole, the pid last (the check above reads it
            # without the lock).
            self.directory.mkdir(parents=True, exist_ok=True)
            # Files of this process's own: after a fork the parent's descriptors share the
            # parent's open files, and so its lock.
            lock = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                ledger = os.open(
                    self.directory / _LEDGER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
                )
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    try:
                        held = _recount(self.directory)
                        _write_ledger(ledger, held)
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)
                except BaseException:
                    os.close(ledger)
                    raise
            except BaseException:
                os.close(lock)
                raise
            self._process_state()
            self.held_bytes = held
            self._fds = (lock, ledger)
            self._pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The lock held: yields the ledger's descriptor."""
        if self._fds is None:
            raise ConfigError(f"cache {self.directory} used before it was opened")
        lock, ledger = self._fds
        with self._thread_lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield ledger
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def stage_key(key: str | None, cache: DiskCache) -> str | None:
    """The key a stage's fingerprint is made of: ``key`` given to the stage's wrapper
    (``cached(..., key=)``), else ``cache.key`` (one for every stage of that cache), else
    None (derived from the stage).

    Raises:
        ConfigError: ``key`` is not a non-empty str or None.
    """
    return cache.key if key is None else _checked_key(key)


def _checked_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"key={key!r} is not valid: expected a non-empty str or None")
    return key


def _read_ledger(fd: int, directory: Path) -> int:
    """The ledger's count (called under the lock); one that is not a count (written by
    something else) is recounted from the files."""
    raw = os.pread(fd, 32, 0).split(b"\n", 1)[0]
    try:
        return int(raw)
    except ValueError:
        used = _recount(directory)
        _write_ledger(fd, used)
        return used


def _write_ledger(fd: int, used: int) -> None:
    # One pwrite of a fixed-width line: a killed process cannot tear a syscall.
    os.pwrite(fd, f"{used:020d}\n".encode(), 0)


def _recount(directory: Path) -> int:
    """Every stage's files' bytes; a dead writer's segment trimmed and sealed (called
    under the lock)."""
    total = 0
    for stage in os.scandir(directory):
        if stage.is_dir(follow_symlinks=False) and _STAGE_DIR.fullmatch(stage.name):
            total += recount_stage(stage.path)
    return total
