"""Where cache entries live: a directory with a byte cap, shared by the processes of a host.

Layout: ``<directory>/<stage>/<index>.bqc``, ``<stage>`` the first 32 hex digits of the
stage's fingerprint (a changed dataset or transform gets a directory of its own; the old
one is never read again, and stays until removed: :meth:`DiskCache.clear`), each entry
a frame (:mod:`producer.cache_entry`). Beside them, ``.lock`` (``flock``ed around every
change) and ``.bytes`` (the ledger: the bytes of every entry and temporary file).

* **Atomic.** An entry is written to ``.tmp-<index>-<host>-<pid>-<bytes>`` in its
  stage's directory and renamed into place (``os.replace``): a reader sees the old file
  or the new one, never a part. A process killed while writing leaves only its
  temporary file.
* **Capped, across processes.** A writer takes the lock, adds the entry's size to the
  ledger if that stays within ``max_bytes`` (else it writes nothing more: the cache
  keeps what it has, a stable part, and never evicts) and creates its temporary file,
  whose name says the size it reserved; it writes the bytes without the lock (measured:
  two producers holding it through their writes lost a quarter of their first epoch to
  each other on 2 loaded cores), then renames under the lock, taking a replaced file's
  bytes off the ledger. So at any moment the files add up to at most the ledger (a file
  being written is never larger than its reservation), and the ledger to at most the cap.
* **Reconciled.** A process's first use takes the lock and recounts the ledger: the
  entries' sizes, and the reservations of live writers (by their temporary files'
  names); a temporary file of a process of this host that no longer runs, or of another
  host untouched for :data:`STALE_S`, is a killed writer's and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchq.errors import ConfigError
from batchq.wire.frame import Pieces

__all__ = ["HOST", "STALE_S", "DiskCache", "default_directory"]

log = logging.getLogger(__name__)

_LOCK = ".lock"
_LEDGER = ".bytes"
_TMP = ".tmp-"
# A temporary file: .tmp-<index>-<host>-<pid>-<reserved bytes>.
_TMP_NAME = re.compile(r"\.tmp-\d+-(?P<host>[A-Za-z0-9_.]*)-(?P<pid>\d+)-(?P<size>\d+)")
#: This host's name as temporary files carry it.
HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())
#: A temporary file of another host untouched this long is a dead writer's (seconds).
STALE_S = 600.0
_SUFFIX = ".bqc"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
_STAGE_DIGITS = 32


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/batchq`` (``~/.cache/batchq``): one directory per host."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchq"


class DiskCache:
    """A directory of cache entries with a byte cap, safe for several processes at once.

    Args:
        directory: where entries live (default :func:`default_directory`); a directory
            on a shared file system with working ``flock`` (NFSv4) serves many hosts.
        max_bytes: the cap on the entries' bytes in ``directory`` (every stage's); None:
            half of the file system's free space and the entries' bytes, when the
            process first writes.
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
        if key is not None and (not isinstance(key, str) or not key):
            raise ConfigError(f"key={key!r} is not valid: expected a non-empty str or None")
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes
        self.key = key
        self._pid: int | None = None  # the process that reconciled (a fork must again)
        self._fds: tuple[int, int] | None = None  # that process's lock and ledger files
        self._made: set[str] = set()  # stage directories known to exist
        self._root = os.fspath(self.directory)  # paths as str: pathlib's cost ~20 us an entry
        self.full = False  # this process found the cap reached: it writes no more
        self.held_bytes = 0  # the ledger as this process last saw it

    # -- what the cached dataset calls --------------------------------------------------

    def read(self, stage: str, index: int) -> bytearray | None:
        """The bytes of entry ``index`` of ``stage`` (a fingerprint), None if absent."""
        self._open()
        try:
            fd = os.open(self._path(stage, index), os.O_RDONLY | _CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.debug("cache entry %s/%d unreadable: %s", stage[:16], index, e)
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            got = os.readv(fd, [buf])
        except OSError as e:
            log.debug("cache entry %s/%d unreadable: %s", stage[:16], index, e)
            return None
        finally:
            os.close(fd)
        return buf if got == size else None

    def write(self, stage: str, index: int, payload: Pieces) -> bool:
        """Store an entry (its buffers, written back to back) atomically if it fits under
        the cap; False when it does not (then this process writes no more) or the disk
        refused."""
        if self.full:
            return False
        self._open()
        size = payload.nbytes
        path = self._path(stage, index)
        tmp = f"{self._stage_dir(stage)}/{_TMP}{index}-{HOST}-{os.getpid()}-{size}"
        fd = self._reserve(path, tmp, size)
        if fd is None:
            return False
        try:
            try:
                _write_all(fd, payload)  # outside the lock: the other writers go on
            finally:
                os.close(fd)
            with self._locked() as fd:
                old = _size(path)
                os.replace(tmp, path)
                if old:
                    self.held_bytes = _read_ledger(fd, self.directory) - old
                    _write_ledger(fd, self.held_bytes)
        except OSError as e:
            self._give_back(tmp, size)
            self.full = True
            log.warning(
                "cache %s: writing failed (%s): no more entries are written", self.directory, e
            )
            return False
        return True

    def _reserve(self, path: str, tmp: str, size: int) -> int | None:
        """Under the lock: add ``size`` to the ledger if it stays within the cap, and
        create the temporary file (its name says its size: a recount counts it); its
        descriptor, open for writing (one open per entry: creating a file is most of a
        write's system time), or None where the cap or the disk refused."""
        with self._locked() as fd:
            used = _read_ledger(fd, self.directory)
            if used + size > self._cap():
                self.full = True
                log.info(
                    "cache %s: %d bytes held, the cap is %d: no more entries are written",
                    self.directory,
                    used,
                    self._cap(),
                )
                return None
            self.held_bytes = used + size
            _write_ledger(fd, used + size)  # first: the ledger never counts less than disk
            try:
                parent = os.path.dirname(path)
                if parent not in self._made:
                    os.makedirs(parent, exist_ok=True)
                    self._made.add(parent)
                try:
                    return os.open(tmp, _CREATE, 0o644)
                except FileNotFoundError:  # its directory removed since (clear())
                    os.makedirs(parent, exist_ok=True)
                    return os.open(tmp, _CREATE, 0o644)
            except OSError as e:
                self.held_bytes = used
                _write_ledger(fd, used)
                self.full = True
                log.warning("cache %s: no entry can be made (%s)", self.directory, e)
                return None

    def _give_back(self, tmp: str, size: int) -> None:
        with self._locked() as fd:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.held_bytes = max(0, _read_ledger(fd, self.directory) - size)
            _write_ledger(fd, self.held_bytes)

    def discard(self, stage: str, index: int) -> None:
        """Remove a rejected entry (its bytes leave the ledger): built again, it may be
        stored again."""
        self._open()
        path = self._path(stage, index)
        with self._locked() as fd:
            size = _size(path)
            if size:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self.held_bytes = max(0, _read_ledger(fd, self.directory) - size)
                _write_ledger(fd, self.held_bytes)

    def bytes_held(self) -> int:
        """The ledger: the bytes of every entry in the directory (all stages)."""
        self._open()
        with self._locked() as fd:
            self.held_bytes = _read_ledger(fd, self.directory)
        return self.held_bytes

    def clear(self) -> None:
        """Remove every entry of every stage (under the lock; the ledger goes to 0)."""
        self._open()
        self._made = set()
        with self._locked() as fd:
            for child in self.directory.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
            self.held_bytes = _recount(self.directory)
            _write_ledger(fd, self.held_bytes)
        self.full = False

    def close(self) -> None:
        """Close this process's lock and ledger files (a later use opens them again)."""
        fds, self._fds, self._pid = self._fds, None, None
        if fds is not None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():  # not a forked copy: its parent's
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pid"] = None  # a copy in another process reconciles on its first use
        state["_fds"] = None  # and opens its own files (a lock is per open file)
        return state

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r}, max_bytes={self.max_bytes}, key={self.key!r})"

    # -- internals ----------------------------------------------------------------------

    def _stage_dir(self, stage: str) -> str:
        return f"{self._root}/{stage[:_STAGE_DIGITS]}"

    def _path(self, stage: str, index: int) -> str:
        return f"{self._root}/{stage[:_STAGE_DIGITS]}/{index}{_SUFFIX}"

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

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        # Files of this process's own: after a fork the parent's descriptors share the
        # parent's open files, and so its lock.
        lock = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        ledger = os.open(self.directory / _LEDGER, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds = (lock, ledger)
        self._made = set()
        with self._locked() as fd:
            self.held_bytes = _recount(self.directory)
            _write_ledger(fd, self.held_bytes)
        self._pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The lock held: yields the ledger's descriptor."""
        if self._fds is None:
            raise ConfigError(f"cache {self.directory} used before it was opened")
        lock, ledger = self._fds
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield ledger
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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


def _write_all(fd: int, payload: Pieces) -> None:
    views = [memoryview(b).cast("B") for b in payload.buffers]
    while views:
        done = os.writev(fd, views[:1024])  # IOV_MAX
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _recount(directory: Path) -> int:
    """The entries' bytes and the live writers' reservations (the sizes their temporary
    files' names say); a dead writer's temporary file is removed (called under the lock)."""
    total = 0
    for stage in os.scandir(directory):
        if not stage.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(stage.path):
            with contextlib.suppress(FileNotFoundError):
                if not entry.name.startswith(_TMP):
                    total += entry.stat(follow_symlinks=False).st_size
                    continue
                reserved = _live_reservation(entry)
                if reserved is None:
                    os.unlink(entry.path)
                else:
                    total += reserved
    return total


def _live_reservation(entry: os.DirEntry[str]) -> int | None:
    """The size a temporary file's writer reserved, None when that writer is gone: a
    process of this host that no longer runs, or one of another host (or a name not
    ours) untouched for :data:`STALE_S`."""
    match = _TMP_NAME.fullmatch(entry.name)
    if match is None:
        return None
    host, pid, size = match["host"], int(match["pid"]), int(match["size"])
    if host == HOST:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # another user's process: alive
        return size
    return None if time.time() - entry.stat().st_mtime > STALE_S else size
