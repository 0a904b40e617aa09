"""A producer's pool of reused shared-memory segments (formats: :mod:`batchq.wire.shm`).

A segment is created once (``posix_fallocate``: the pages are reserved up front, so a
full folder is an error here, never a SIGBUS later), mapped once, and overwritten frame
after frame: in steady state there is no allocation and no page fault. The producer
overwrites a segment only when its header says ``released == gen`` for every group slot
its frame went to (:func:`batchq.wire.shm.all_released`), which each group's trainer
writes when nothing of the batch inside is referenced any more (see
:mod:`consumer.reader.shm_frames`); no trainer ever has to answer through Redis.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct

from batchq.wire.shm import (
    HEADER,
    HEADER_BYTES,
    OFF_GEN,
    OFF_LEN,
    OFF_RELEASED,
    OFF_RETIRED,
    OFF_TARGETS,
    SEGMENT_MAGIC,
    SEGMENT_MODE,
    SEGMENT_VERSION,
    all_released,
    segment_name,
)

__all__ = ["FULL", "NO_ROOM", "Segment", "SegmentPool"]

log = logging.getLogger(__name__)

FULL = "full"  # the folder (or shm_max_bytes) has no room for another segment
NO_ROOM = "no_room"  # every segment still holds a batch the trainer has not let go
_U64 = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE


class Segment:
    """One segment file, mapped read-write by its producer."""

    def __init__(self, name: str, path: str, mm: mmap.mmap, capacity: int, ino: int) -> None:
        self.name = name
        self.path = path
        self.mm = mm
        self.capacity = capacity
        self.ino = ino
        self.gen = 0

    def is_free(self) -> bool:
        """Whether every trainer it went to is done with the last frame written here."""
        return all_released(self.mm, self.gen)

    def body(self, nbytes: int) -> memoryview:
        """Where the next frame of ``nbytes`` goes."""
        return memoryview(self.mm)[HEADER_BYTES : HEADER_BYTES + nbytes]

    def commit(self, nbytes: int, targets: int = 1) -> int:
        """The frame is written: publish its length and the group slots it goes to
        (``targets``, a mask), then its generation; returns it."""
        self.gen += 1
        _U64.pack_into(self.mm, OFF_LEN, nbytes)
        _U64.pack_into(self.mm, OFF_TARGETS, targets)
        _U64.pack_into(self.mm, OFF_GEN, self.gen)
        return self.gen

    def retarget(self, gen: int, targets: int) -> None:
        """The push of ``gen`` left some groups out (detached): only ``targets`` got it,
        and only they will release it."""
        if gen == self.gen and not self.mm.closed:
            _U64.pack_into(self.mm, OFF_TARGETS, targets)

    def abandon(self, gen: int) -> None:
        """The frame of ``gen`` never reached a list: the segment is free again (a no-op
        once the pool let it go: the run changed while the frame waited at the cap)."""
        if gen == self.gen and not self.mm.closed:
            _U64.pack_into(self.mm, OFF_TARGETS, 1)
            _U64.pack_into(self.mm, OFF_RELEASED, gen)

    def unlink(self) -> None:
        """Remove the file (a trainer that mapped it keeps its mapping) and unmap."""
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino == self.ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove shared-memory segment %s: %s", self.path, e)
        with contextlib.suppress(BufferError):  # a view is alive; the mapping goes with it
            self.mm.close()


class SegmentPool:
    """The segments of one producer in one run.

    Args:
        shm_dir: the shared-memory folder.
        queue: the queue.
        producer: the producer's id.
        max_segments: the most segments at once (then frames go through Redis).
        max_bytes: the most bytes of segments at once (None: only the folder's size).
    """

    def __init__(
        self, shm_dir: str, queue: str, producer: str, max_segments: int, max_bytes: int | None
    ) -> None:
        self.shm_dir = shm_dir
        self.queue = queue
        self.producer = producer
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.run = ""
        self.segments: list[Segment] = []
        self._n = 0
        self.last_error = ""

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the pool holds."""
        return sum(HEADER_BYTES + s.capacity for s in self.segments)

    def acquire(self, nbytes: int) -> Segment | str:
        """A free segment of at least ``nbytes``, or why there is none (FULL, NO_ROOM)."""
        best = self._smallest_free(nbytes)
        if best is not None:
            return best
        capacity = -(-(nbytes + nbytes // 16) // _PAGE) * _PAGE  # room for a bit of growth
        self._make_room(capacity, nbytes)
        if not self._fits(capacity):
            if len(self.segments) >= self.max_segments:
                return NO_ROOM
            self.last_error = f"shm_max_bytes={self.max_bytes} reached"
            return FULL
        return self._create(capacity)

    def _smallest_free(self, nbytes: int) -> Segment | None:
        """The smallest free segment that holds ``nbytes``, if any."""
        best: Segment | None = None
        for seg in self.segments:
            smaller = best is None or seg.capacity < best.capacity
            if seg.capacity >= nbytes and smaller and seg.is_free():
                best = seg
        return best

    def _make_room(self, capacity: int, nbytes: int) -> None:
        """Free segments too small for a frame of ``nbytes`` make room for one of
        ``capacity`` that fits."""
        small = [s for s in self.segments if s.capacity < nbytes and s.is_free()]
        while small and not self._fits(capacity):
            seg = small.pop()
            self.segments.remove(seg)
            seg.unlink()

    def _fits(self, capacity: int) -> bool:
        if len(self.segments) >= self.max_segments:
            return False
        return self.max_bytes is None or self.nbytes + HEADER_BYTES + capacity <= self.max_bytes

    def _create(self, capacity: int) -> Segment | str:
        size = HEADER_BYTES + capacity
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            self._n += 1
            name = segment_name(self.queue, self.run, self.producer, self._n)
            path = os.path.join(self.shm_dir, name)
            try:
                fd = os.open(path, flags, SEGMENT_MODE)
                break
            except FileExistsError:  # left by an earlier process with this id: skip it
                continue
            except OSError as e:
                self.last_error = f"cannot create {path}: {e}"
                return FULL
        try:
            os.fchmod(fd, SEGMENT_MODE)
            # Reserve the pages now: on a full tmpfs this fails with ENOSPC, where a
            # sparse file would fault (SIGBUS) on the first write past the limit.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            ino = os.fstat(fd).st_ino
        except OSError as e:
            os.unlink(path)
            self.last_error = f"cannot allocate {size} bytes in {self.shm_dir}: {e}"
            if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG):
                log.debug("segment %s: %s", path, e)
            return FULL
        finally:
            os.close(fd)
        HEADER.pack_into(mm, 0, SEGMENT_MAGIC, SEGMENT_VERSION, 0, 0, 0, 0, 1)
        seg = Segment(name, path, mm, capacity, ino)
        self.segments.append(seg)
        return seg

    def reset(self, run: str) -> None:
        """Drop every segment (a new run: nothing of the old one will be popped)."""
        for seg in self.segments:
            seg.unlink()
        self.segments = []
        self.run = run
        self._n = 0

    def retire(self) -> None:
        """Start afresh in the same run (a rejoin: this producer may have been reaped,
        and the trainer may remove a reaped producer's free segments): the old segments
        are never written again; new ones get new numbers."""
        self.close(finished=False)

    def close(self, finished: bool) -> None:
        """Leave: remove the segments, except those whose batch the trainer may still
        pop or hold (unless the run finished); the trainer removes those on release."""
        for seg in self.segments:
            if finished or seg.is_free():
                seg.unlink()
                continue
            _U64.pack_into(seg.mm, OFF_RETIRED, 1)
            if seg.is_free():  # released meanwhile: the trainer may not have seen retired
                seg.unlink()
        self.segments = []
