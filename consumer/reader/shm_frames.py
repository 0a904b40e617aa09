"""The trainer's side of shared memory: publish the host, map segments, release them.

Reuse is enforced by reference counting, not by timing. For each descriptor the
trainer makes one *owner*: a fresh read-only uint8 array over the segment's frame
bytes (``np.frombuffer`` of the segment's mapping). The codec decodes from the owner,
so every array of the batch is a view whose ``.base`` chain holds the owner (array ->
memoryview -> owner -> mapping); a tensor made with ``torch.from_numpy`` holds the array.
``weakref.finalize(owner, ...)`` writes ``released = gen`` into the segment's header
(the release word of the trainer's group slot: a segment several groups read is mapped
by each group's trainer, and reused once every one of them released it) only when the
owner is freed, i.e. when no array, view or tensor of the batch is left
(a bad frame, or a ``writable=True`` trainer's batch, which is copied into memory of
its own: at once). The torch adapter instead asks for writable views
(``views_writable``): its tensors are the segment's memory, zero-copy, and hold it as
long as they are referenced. A second descriptor of the same generation (a duplicate, a
replayed push) gets the same owner, never one of its own, so dropping it releases
nothing; once released, a descriptor of a batch this trainer had (the last SEEN_MAX it
resolved) is a duplicate and dropped unread, like any duplicate frame, and any other
of a released generation is stale (the producer may be writing the next one). The
producer overwrites a segment only when ``released == gen``. A batch the trainer gives
back unread at its close (:mod:`consumer.detach`) is given back as its descriptor
(:meth:`TrainerShm.descriptors`) and handed over (:meth:`TrainerShm.hand_over`): its
owner, when freed, writes nothing, so the segment holds the batch for the trainer that
pops the descriptor next (which releases it as any). A segment is mapped once
and the mapping is shared by its generations; it is unmapped when the last owner over
it is gone and the cache dropped it.

Every descriptor is checked before a byte is read: this queue's segment name (no path,
no other queue), this host, a regular file of this user opened without following
links, with mode 0600 and one link (a hard link to another queue's segment would have
the trainer release that queue's batch), big enough, and holding the generation the
descriptor names, not released yet. Anything else is a bad frame
(:class:`~batchq.errors.FrameError`, to the dead list with its reason).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import struct
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from batchq.client.connection import call
from batchq.errors import FrameError
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from batchq.wire.frame import Frame
from batchq.wire.shm import (
    DEFAULT_SHM_DIR,
    HEADER,
    HEADER_BYTES,
    OFF_RETIRED,
    SEGMENT_MAGIC,
    SEGMENT_MODE,
    SEGMENT_VERSION,
    Descriptor,
    SegmentName,
    all_released,
    decode_descriptor,
    encode_descriptor,
    host_identity,
    list_segments,
    parse_segment_name,
    release_offset,
    remove_segments,
    resolve_transport,
)
from consumer.reader.prepare import ArrayAccess

__all__ = ["MAX_MAPPED", "SEEN_MAX", "SWEEP_S", "ShmKey", "TrainerShm"]

log = logging.getLogger(__name__)

MAX_MAPPED = 1024  # segments kept mapped; older ones are unmapped once unreferenced
SWEEP_S = 5.0  # how often the reader looks for segments of producers that are gone
SEEN_MAX = 8192  # batches remembered as had (segment, inode, generation): duplicates
_U64 = struct.Struct("<Q")

#: A batch in a segment: (segment name, inode, generation).
ShmKey = tuple[str, int, int]


class _Hold:
    """Whether a batch's release is still this trainer's to write: one it handed over
    (its descriptor given back to the list) is the next trainer's."""

    __slots__ = ("__weakref__", "handed_over")

    def __init__(self) -> None:
        self.handed_over = False


def _release(mm: mmap.mmap, gen: int, path: str, ino: int, offset: int, hold: _Hold) -> None:
    """The batch of ``gen`` is no longer referenced: hand the segment back (the word at
    ``offset``: this trainer's group slot's), unless the batch was handed over."""
    if hold.handed_over:
        return
    try:
        _U64.pack_into(mm, offset, gen)
        # Its producer left (retired): nobody reuses it, so it goes once every group
        # it went to is done with it.
        retired = _U64.unpack_from(mm, OFF_RETIRED)[0]
        if retired and all_released(mm, gen) and os.stat(path, follow_symlinks=False).st_ino == ino:
            os.unlink(path)
    except (ValueError, OSError):  # unmapped or already removed: nothing to hand back
        pass


def _remove_if_released(path: str) -> bool:
    """Remove a segment whose last batch was released (its producer is gone); False if
    it still holds one, or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        if len(head) < HEADER_BYTES:
            return False
        magic, _version, gen, *_rest = HEADER.unpack_from(head)
        if magic == SEGMENT_MAGIC and all_released(head, gen):
            os.unlink(path)
            return True
    except OSError:
        pass
    return False


class TrainerShm:
    """Shared memory for one trainer.

    Args:
        keys: the queue's keys.
        transport: 'auto' or 'redis' (None: ``BATCHQ_TRANSPORT``, else 'auto').
        shm_dir: the shared-memory folder (default /dev/shm).
        writable: the trainer asked for writable arrays: each batch is copied out of
            its segment into memory of its own (the arrays own it), and the segment is
            released at once.
        rank: the trainer's rank (its host is published per rank: ranks of one job may
            run on different hosts).
        world: the job's number of ranks.
    """

    def __init__(
        self,
        keys: QueueKeys,
        transport: str | None,
        shm_dir: str | None,
        writable: bool = False,
        *,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.keys = keys
        # What the arrays may be: the stream hands its FramePrep's over when reading starts.
        self.access = ArrayAccess.WRITABLE if writable else ArrayAccess.READ_ONLY
        self.rank, self.world = rank, world
        self.slot = 0  # the group slot read (publish sets it): its release word is written
        self.host_field = reader_field(MetaField.SHM_HOST, 0, rank, world)
        self.lookahead_field = reader_field(MetaField.SHM_LOOKAHEAD, 0, rank, world)
        self.mode = resolve_transport(transport)
        self.shm_dir = shm_dir or DEFAULT_SHM_DIR
        self.identity = host_identity(self.shm_dir) if self.mode == "auto" else None
        self._mapped: OrderedDict[str, tuple[int, int, mmap.mmap, int]] = OrderedDict()
        # (segment, inode, generation) -> the live owner of that batch: duplicates
        # share it; and the batches resolved lately, to know a late duplicate.
        self._owners: weakref.WeakValueDictionary[tuple[str, int, int], Any] = (
            weakref.WeakValueDictionary()
        )
        self._seen: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        # The live owners' holds (a hold lives as long as its owner's finalizer).
        self._holds: weakref.WeakValueDictionary[ShmKey, _Hold] = weakref.WeakValueDictionary()
        self.duplicates = 0  # descriptors of batches already had, dropped unread
        self._run = ""  # the run this trainer reads (set by new_run)
        self._mapped_run = ""  # the run of the segments in the mapping cache
        self._swept = time.monotonic()
        self.frames = 0  # frames received through shared memory
        self.swept = 0  # segments of gone producers removed by sweep()

    def sibling(self, keys: QueueKeys) -> TrainerShm:
        """The same trainer's shared memory for another queue: a stripe of this one
        (:mod:`batchq.protocol.stripes`), whose segments and host are its own."""
        writable = self.access is not ArrayAccess.READ_ONLY
        return TrainerShm(keys, self.mode, self.shm_dir, writable, rank=self.rank, world=self.world)

    def publish(self, client: redis.Redis, lookahead: int, slot: int = 0) -> None:
        """Tell the producers this trainer's host and its look-ahead (the decoded frames
        it may hold ahead of its caller), or that it takes nothing by shared memory;
        ``slot``: the group slot it reads (it releases segments in that slot's word).

        Called after every acquire and resume: those scripts drop the published host
        (a takeover, a new run), so that no descriptor for the previous trainer's host
        is pushed into this trainer's list (push.lua checks it)."""
        self.slot = slot
        self.host_field = reader_field(MetaField.SHM_HOST, slot, self.rank, self.world)
        self.lookahead_field = reader_field(MetaField.SHM_LOOKAHEAD, slot, self.rank, self.world)
        meta = self.keys.meta
        if self.identity is None:
            fields = (self.host_field, self.lookahead_field)
            call(lambda: client.hdel(meta, *fields), "publishing the host")
        else:
            items: list[str | int] = [
                self.host_field,
                self.identity,
                self.lookahead_field,
                lookahead,
            ]
            call(lambda: client.hset(meta, items=items), "publishing the host")

    def new_run(self, run: str) -> None:
        """A run started: segments of other runs of this queue on this host go (also
        for a trainer that takes nothing by shared memory: a killed run's are left)."""
        self._run = run
        remove_segments(self.shm_dir, self.keys.queue, keep_run=run)

    def maybe_sweep(self, client: redis.Redis) -> int:
        """Every SWEEP_S: remove this run's segments of producers that are gone (killed
        and reaped, or left) and whose last batch the trainer is done with.

        Safe because: the folder is listed *before* the producers are read, and a
        producer joins before it creates a segment, so one absent from the read was
        reaped or left after making it; a reaped producer's pushes are refused (its
        leases are gone) and when it joins again it retires every segment it had
        (:meth:`producer.serving.shm_pool.SegmentPool.retire`), so a removed segment is never
        written or named again. One still holding a batch (``released != gen``) stays;
        it goes when released, or with the run.
        """
        now = time.monotonic()
        if self.identity is None or not self._run or now - self._swept < SWEEP_S:
            return 0
        self._swept = now
        listed = self._listed()
        if not listed:
            return 0
        members = call(lambda: client.zrangebyscore(self.keys.producers, "-inf", "+inf"), "reading")
        alive = {m.decode() for m in members}  # type: ignore[union-attr]
        removed = 0
        for name, parsed in listed:
            if parsed.producer not in alive:
                removed += _remove_if_released(os.path.join(self.shm_dir, name))
        if removed:
            log.info("queue %s: removed %d segments of gone producers", self.keys.queue, removed)
        self.swept += removed
        return removed

    def _listed(self) -> list[tuple[str, SegmentName]]:
        """This run's segments on this host: (name, parsed name)."""
        return [
            (n, p) for n, p in list_segments(self.shm_dir, self.keys.queue) if p.run == self._run
        ]

    def finish(self, run: str) -> None:
        """Run ``run`` finished: its segments on this host go (only its: once it is
        marked finished a new run may start, whose producers here make segments at once)."""
        remove_segments(self.shm_dir, self.keys.queue, only_run=run)

    def resolve(self, element: bytes) -> np.ndarray[Any, np.dtype[np.uint8]] | memoryview | None:
        """The frame's bytes for a descriptor: a read-only array owning the batch, or
        for a ``writable=True`` trainer a copy of its own (the segment released); None
        for a duplicate of a batch this trainer had and released (dropped unread).

        Raises:
            FrameError: a bad descriptor (``shm_bad``, ``shm_outside``,
                ``shm_foreign_host``, ``shm_unavailable``, ``shm_missing``,
                ``shm_wrong_size``, ``shm_stale``).
        """
        desc = decode_descriptor(element, self.keys.queue)
        if desc.host != self.identity:
            raise self._host_error(desc)
        path = os.path.join(self.shm_dir, desc.segment)
        try:
            ino, size, mm, _dev = self._map(desc.segment, path)
        except FrameError as e:
            if e.reason == "shm_missing" and self._had(desc.segment, desc.gen):
                # A batch had and released whose segment went since (its producer left
                # or was reaped), listed again: a pop a Redis failover lost.
                self.duplicates += 1
                return None
            raise
        if HEADER_BYTES + desc.length > size:
            raise FrameError(
                "shm_wrong_size",
                f"segment {desc.segment} has {size - HEADER_BYTES} bytes, "
                f"the descriptor says {desc.length}",
            )
        magic, version, gen, _released, _retired, length, _targets = HEADER.unpack_from(mm)
        released = _U64.unpack_from(mm, release_offset(self.slot))[0]
        key = (desc.segment, ino, desc.gen)
        owner = self._owners.get(key)
        if owner is None and key in self._seen:
            self.duplicates += 1  # a replayed push of a batch already had: never read
            return None
        if (magic, version) != (SEGMENT_MAGIC, SEGMENT_VERSION) or (gen, length) != (
            desc.gen,
            desc.length,
        ):
            raise FrameError(
                "shm_stale",
                f"segment {desc.segment} holds generation {gen} of {length} bytes, "
                f"the descriptor names generation {desc.gen} of {desc.length}",
            )
        if owner is None:
            owner = self._new_owner(key, mm, desc.length, path, released)
        self.frames += 1
        if self.access is ArrayAccess.WRITABLE:
            # Copied into memory the arrays own; the owner goes here: released at once.
            return memoryview(bytearray(owner))
        return owner

    def descriptors(self, frames: Sequence[Frame]) -> list[tuple[bytes, ShmKey] | None]:
        """For each frame, the descriptor it was resolved from and its batch's key, where
        every array of the frame is a view of its batch in the segment, still unreleased
        (the batch as popped); None for anything else (an inline frame, a copy, a value
        the reader made anew)."""
        if self.identity is None:
            return [None] * len(frames)
        owners = {id(owner): key for key, owner in self._owners.items()}
        return [self._descriptor(frame, owners, self.identity) for frame in frames]

    def _descriptor(
        self, frame: Frame, owners: dict[int, ShmKey], identity: str
    ) -> tuple[bytes, ShmKey] | None:
        """One frame's descriptor and key (:meth:`descriptors`), or None."""
        keys = {_owner_key(v, owners) for v in frame.data if isinstance(v, np.ndarray)}
        key = keys.pop() if len(keys) == 1 else None
        owner = self._owners.get(key) if key is not None else None
        if key is None or owner is None:
            return None
        return encode_descriptor(key[0], key[2], owner.nbytes, identity), key

    def hand_over(self, keys: list[ShmKey], handed: bool = True) -> None:
        """The batches of ``keys`` are given back as their descriptors: their owners,
        when freed, release nothing (the trainer that pops them does); ``handed=False``
        takes that back (the give-back was refused)."""
        for key in keys:
            hold = self._holds.get(key)
            if hold is not None:
                hold.handed_over = handed

    def _had(self, segment: str, gen: int) -> bool:
        """Whether this trainer resolved generation ``gen`` of ``segment`` (any inode)."""
        return any(s == segment and g == gen for s, _ino, g in self._seen)

    def release_unread(self, element: bytes) -> bool:
        """Hand back the segment of a descriptor this trainer popped and will never read
        (its group finished while its list held it), as a batch it read is handed back:
        its group slot's release word; False where there is nothing of ours to release
        (another host's, not this queue's, or another generation by now)."""
        try:
            desc = decode_descriptor(element, self.keys.queue)
            if desc.host != self.identity:
                return False
            path = os.path.join(self.shm_dir, desc.segment)
            ino, _size, mm, _dev = self._map(desc.segment, path)
        except FrameError:
            return False
        if HEADER.unpack_from(mm)[2] != desc.gen:
            return False
        _release(mm, desc.gen, path, ino, release_offset(self.slot), _Hold())
        return True

    def _host_error(self, desc: Descriptor) -> FrameError:
        """The bad frame for a descriptor of another host (or a trainer without shm)."""
        if self.identity is None:
            return FrameError("shm_unavailable", f"segment {desc.segment}: this trainer has no shm")
        return FrameError(
            "shm_foreign_host",
            f"segment {desc.segment} is on host {desc.host[:80]!r}, not this one",
        )

    def _new_owner(
        self, key: tuple[str, int, int], mm: mmap.mmap, length: int, path: str, released: int
    ) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The owner of a batch not had before: released into its segment when freed.

        Raises:
            FrameError: ``shm_stale``, the generation was released already.
        """
        segment, ino, gen = key
        if released >= gen:
            raise FrameError(
                "shm_stale", f"segment {segment}: generation {gen} was released already"
            )
        owner = np.frombuffer(mm, dtype=np.uint8, count=length, offset=HEADER_BYTES)
        owner.flags.writeable = self.access is ArrayAccess.VIEWS
        hold = _Hold()
        weakref.finalize(owner, _release, mm, gen, path, ino, release_offset(self.slot), hold)
        self._owners[key] = owner
        self._holds[key] = hold
        self._seen[key] = None
        if len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        return owner

    def _map(self, name: str, path: str) -> tuple[int, int, mmap.mmap, int]:
        """(inode, size, mapping, device) of a segment: the cached mapping while the file
        is the one mapped, else a fresh one of the checked file."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise FrameError("shm_missing", f"segment {path} does not exist") from None
        except OSError as e:
            raise FrameError("shm_missing", f"segment {path}: {e}") from None
        cached = self._mapped.get(name)
        # Same file and size as mapped (a segment never changes size; one that shrank
        # under the mapping would fault on read, so it is looked at afresh).
        if cached is not None and cached[:2] == (st.st_ino, st.st_size) and cached[3] == st.st_dev:
            self._mapped.move_to_end(name)
            return cached
        entry = _map_checked(path)
        self._remember(name, entry)
        return entry

    def _remember(self, name: str, entry: tuple[int, int, mmap.mmap, int]) -> None:
        """Cache a fresh mapping: the newest MAX_MAPPED, of the newest run only."""
        parsed = parse_segment_name(name)
        if parsed is not None and parsed.run != self._mapped_run:
            # Mappings of another run will not be asked for again; owners keep theirs.
            for old in [n for n in self._mapped if n.split("-")[2] != parsed.run]:
                del self._mapped[old]
            self._mapped_run = parsed.run
        self._mapped[name] = entry
        while len(self._mapped) > MAX_MAPPED:
            self._mapped.popitem(last=False)


def _owner_key(value: Any, owners: dict[int, ShmKey]) -> ShmKey | None:
    """The key of the owner ``value`` is a view of (array -> memoryview -> owner, or a
    view of a view), or None."""
    for _ in range(8):  # the codec's views are a few levels deep; a copy has no base
        key = owners.get(id(value))
        if key is not None:
            return key
        value = value.base if isinstance(value, np.ndarray) else getattr(value, "obj", None)
        if value is None:
            return None
    return None


def _map_checked(path: str) -> tuple[int, int, mmap.mmap, int]:
    """Open a segment without following links and map it, once it checks out: a
    regular file of this user, mode 0600, one link, at least its header.

    Raises:
        FrameError: ``shm_missing``, ``shm_outside`` or ``shm_wrong_size``.
    """
    try:
        # O_NONBLOCK: a FIFO named as a segment must not block the open.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FrameError("shm_missing", f"segment {path} does not exist") from None
    except OSError as e:  # ELOOP: a symlink; EACCES: not ours
        raise FrameError("shm_outside", f"segment {path} cannot be opened: {e}") from None
    try:
        st = os.fstat(fd)
        _check_segment_file(path, st)
        try:
            mm = mmap.mmap(fd, st.st_size)
        except (OSError, ValueError) as e:  # ENOMEM: vm.max_map_count reached
            raise FrameError("shm_missing", f"segment {path} cannot be mapped: {e}") from None
    finally:
        os.close(fd)
    return (st.st_ino, st.st_size, mm, st.st_dev)


def _check_segment_file(path: str, st: os.stat_result) -> None:
    """Refuse an opened file that is not a segment batchq's producers made."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise FrameError("shm_outside", f"segment {path} is not a regular file of this user")
    if stat.S_IMODE(st.st_mode) != SEGMENT_MODE or st.st_nlink != 1:
        raise FrameError(
            "shm_outside",
            f"segment {path} has mode {stat.S_IMODE(st.st_mode):04o} and "
            f"{st.st_nlink} links, expected {SEGMENT_MODE:04o} and 1",
        )
    if st.st_size < HEADER_BYTES:
        raise FrameError(
            "shm_wrong_size", f"segment {path} has {st.st_size} bytes, below its header"
        )
