"""Which way a producer's frames travel: shared memory on the trainer's host, else Redis.

``transport='auto'`` (the default; ``BATCHQ_TRANSPORT`` sets it where the argument is
not given) uses shared memory for a frame exactly while the trainer (the rank) it goes
to (in a run read by several groups: every group's trainer of that rank it goes to, each
mapping the same segment) has published this host's identity
(:func:`batchq.wire.shm.host_identity`, meta field
:data:`batchq.protocol.fields.MetaField.SHM_HOST`, one per rank): a producer started before the
trainer switches once the identity appears, and back to Redis when a trainer from
another host takes over; ranks on other hosts get their frames through Redis. It reads
the fields at every join and at most once a second while serving; push.lua refuses a
descriptor whose host is not the rank's published one at that moment (``REROUTE``:
the producer sends the frame itself), so a lagging read never misroutes a frame.

The pool holds at most ``shm_segments`` segments; by default just enough that a
trainer keeping up never makes a frame fall back to Redis: per rank on this host, the
rank's data list (the run's ``list_cap``, :class:`producer.serving.membership.RunPosition`),
the decoded frames the rank's reader holds ahead of its caller (its *reader prefetch*:
the trainer's hwm, published beside the host as
:data:`batchq.protocol.fields.MetaField.SHM_LOOKAHEAD`) and the two batches the caller
has in hand (the one it uses, the one it is handed next), plus the producer's own two:
the one being pushed and the next one, built ahead (:mod:`producer.serving.ahead`).
``transport='redis'`` never uses shared memory. Either way, frames that do not get a
segment (the folder is full, ``shm_max_bytes`` is reached, or every segment still holds
a batch the trainer keeps) go through Redis: one warning for a full folder, never an
error, never a lost batch.

When every segment still holds a batch, the trainer usually lets one go within a step
(its caller moves on to the next batch): the producer waits up to
:data:`NO_ROOM_WAIT_S` for that before it sends the frame through Redis, which costs both
sides about ten times as much CPU as the frame it would have waited for. A wait that
timed out (a trainer keeping batches: a list of them, a slow step) makes the next frames
go through Redis at once, until a segment is free again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from batchq.client.connection import Pieces, call
from batchq.errors import ConfigError
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field, slots_of
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from batchq.wire import codec
from batchq.wire.shm import (
    DEFAULT_SHM_DIR,
    encode_descriptor,
    host_identity,
    remove_segments,
    resolve_transport,
)
from producer.serving.membership import RunPosition
from producer.serving.shm_pool import FULL, NO_ROOM, Segment, SegmentPool

__all__ = [
    "DEFAULT_READER_PREFETCH",
    "MAX_READER_PREFETCH",
    "NO_ROOM_POLL_S",
    "NO_ROOM_WAIT_S",
    "REFRESH_S",
    "ShmFrame",
    "Transport",
    "pool_size",
]

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how often a serving producer looks at the trainer's host identity
# Every segment holds a batch: wait this long for the trainer to let one go, looking
# every NO_ROOM_POLL_S (bench/torch_loader.py, two queues read in turn: without the
# wait about one 12.6 MB frame in ten went through Redis at the turn, at ~10x the cost).
NO_ROOM_WAIT_S = 0.02
NO_ROOM_POLL_S = 0.0005
DEFAULT_READER_PREFETCH = 10  # a trainer that published none: the consumer's default hwm
MAX_UNCERTAIN = 64  # pushes whose reply was lost, remembered until the next join
# How long after a rejoin a segment whose descriptor was in no list is kept: the trainer
# may have popped the descriptor just before the look and not mapped it yet (it maps a
# frame in the step that popped it, milliseconds later).
UNLISTED_GRACE_S = 2.0
# Whatever meta says, a pool never grows past this reader prefetch (memory stays bounded).
MAX_READER_PREFETCH = 1024
IN_HAND = 2  # batches a rank's caller holds: the one it uses and the one handed next
OUTSIDE = 2  # a producer's frames outside the list: the one pushed, one built ahead


def pool_size(list_cap: int, reader_prefetch: int, world: int) -> int:
    """The default pool: what a run of ``world`` ranks can hold of one producer's
    frames at once (every list of ``list_cap``, reader prefetch and hand full of them),
    plus the frame being pushed and the one built ahead."""
    return world * (list_cap + reader_prefetch + IN_HAND) + OUTSIDE


def _reader_prefetch(value: object) -> int:
    """The published reader prefetch, or the default where meta holds none or nonsense."""
    try:
        n = int(value) if isinstance(value, bytes | str) else DEFAULT_READER_PREFETCH
    except ValueError:
        return DEFAULT_READER_PREFETCH
    return min(n, MAX_READER_PREFETCH) if n >= 1 else DEFAULT_READER_PREFETCH


class ShmFrame:
    """A frame written into a segment; the list gets :attr:`element`, its descriptor."""

    def __init__(self, element: bytes, nbytes: int, segment: Segment, gen: int, host: str) -> None:
        self.element = element
        self.nbytes = nbytes
        self.segment = segment
        self.gen = gen
        self.host = host  # the identity the descriptor names

    def __len__(self) -> int:
        return self.nbytes  # the batch's size, for the accounting

    def abandon(self) -> None:
        """The push was refused for good: the segment is free again."""
        self.segment.abandon(self.gen)

    def retarget(self, targets: int) -> None:
        """Only the group slots of ``targets`` got the descriptor (the push left the
        others out): only they release it."""
        self.segment.retarget(self.gen, targets)

    def detach(self) -> memoryview:
        """The frame's bytes copied out of the segment, which is free again (the push
        was refused with REROUTE: the frame goes through Redis instead)."""
        data = memoryview(bytes(self.segment.body(self.nbytes)))
        self.abandon()
        return data


class Transport:
    """One producer's choice of transport, and its segments.

    Args:
        transport: 'auto' or 'redis' (None: ``BATCHQ_TRANSPORT``, else 'auto').
        shm_dir: the shared-memory folder.
        queue: the queue's keys.
        producer: the producer's id.
        max_segments: the most segments the producer holds at once (None: follow the
            run's shape and cap, :func:`pool_size`, from each join on).
        max_bytes: the most bytes of segments it holds at once (None: no own limit).
    """

    def __init__(
        self,
        transport: str | None,
        shm_dir: str | None,
        keys: QueueKeys,
        producer: str,
        max_segments: int | None,
        max_bytes: int | None = None,
    ) -> None:
        self.mode = resolve_transport(transport)
        self.shm_dir = shm_dir or DEFAULT_SHM_DIR
        for name, value in (("shm_segments", max_segments), ("shm_max_bytes", max_bytes)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(
                    f"{name} {value!r} is not valid: expected an integer >= 1 or None"
                )
        self.keys = keys
        self.producer = producer
        self.identity = host_identity(self.shm_dir) if self.mode == "auto" else None
        self._fixed = max_segments
        # The run served (its ranks, group slots and cap), as the last join gave it.
        self._position = RunPosition()
        # Until a join reads the trainers' hosts, none is here: the producer's own two
        # (each refresh sizes the pool for the readers on this host).
        size = max_segments or OUTSIDE
        self.pool = SegmentPool(self.shm_dir, keys.queue, producer, size, max_bytes)
        # The readers (group slot, rank) whose trainer is on this host.
        self._local: tuple[tuple[int, int], ...] = ()
        self._checked = -REFRESH_S
        self._warned = False
        self.shm_frames = 0  # frames sent through shared memory
        self.fallbacks = 0  # frames that wanted shared memory and went through Redis
        self.no_room_waits = 0  # frames that waited for the trainer to let a segment go
        self.reroutes = 0  # descriptors push.lua refused: the frame went through Redis
        # Descriptors whose push lost its reply, with their data list: looked at when the
        # producer joins again (see joined).
        self._uncertain: list[tuple[ShmFrame, str]] = []
        # Their segments found in no list at a rejoin, removed at _unlisted_at unless the
        # trainer let them go by then (see _drop_unlisted).
        self._unlisted: list[Segment] = []
        self._unlisted_at = 0.0
        self._patient = True  # the last wait for a segment did not time out
        # Until then (monotonic s; set by a join), a rank with no published host is
        # looked at before every batch: its trainer may be between its claim or resume
        # (which drop the host) and its publish, a few ms later.
        self._eager_until = 0.0

    def joined(self, client: redis.Redis, position: RunPosition) -> None:
        """After a join to ``position``: a new run drops the old segments, a rejoin of
        the same run retires them; look at the trainer's host."""
        self._position = position
        run = position.run
        if self.identity is None:
            return
        if run == self.pool.run:
            self._drop_unlisted(client)
            self.pool.retire()  # a rejoin: never reuse a segment from before it
        else:
            self._remove_unlisted()  # of the old run: nothing will pop them now
            self.pool.reset(run)
            # Segments of other runs whose producers are gone (killed): nothing will
            # pop them. Live producers' are theirs to drop (they may be in a newer run).
            # (ZRANGEBYSCORE: what the producer ACL role of deploy/acl.conf may run.)
            members = call(
                lambda: client.zrangebyscore(self.keys.producers, "-inf", "+inf"), "reading"
            )
            alive = {p.decode() for p in members}  # type: ignore[union-attr]
            remove_segments(
                self.shm_dir, self.keys.queue, keep_run=run, keep_producers=alive - {self.producer}
            )
        self._eager_until = time.monotonic() + REFRESH_S
        self.refresh(client, force=True)

    def regrouped(self, client: redis.Redis, position: RunPosition) -> None:
        """More groups read the run now (``position``: the same run, its group slots
        and their ranks): look at their trainers' hosts at once."""
        self._position = position
        self.refresh(client, force=True)

    def uncertain(self, frame: ShmFrame, data_key: str) -> None:
        """A push of ``frame`` into ``data_key`` failed before its reply came back."""
        self._uncertain = [*self._uncertain[-(MAX_UNCERTAIN - 1) :], (frame, data_key)]

    def _drop_unlisted(self, client: redis.Redis) -> None:
        """At a rejoin: a segment whose push lost its reply and whose descriptor is not in
        its list never reached it, or the trainer popped it already; left to the
        retirement, one that never reached it would stay until the run ends, so it is
        removed after UNLISTED_GRACE_S unless the trainer let it go by then (a trainer
        that mapped it keeps its mapping; removed at once, one popped just before the
        look but not mapped yet was missing to the trainer: shm_missing)."""
        uncertain, self._uncertain = self._uncertain, []
        for frame, data_key in uncertain:
            seg = frame.segment
            if seg not in self.pool.segments or seg.gen != frame.gen or seg.is_free():
                continue
            listed = call(
                functools.partial(client.lpos, data_key, frame.element),  # type: ignore[arg-type]
                "reading the list",
            )
            if listed is None and seg not in self._unlisted:
                self._unlisted.append(seg)
                self._unlisted_at = time.monotonic() + UNLISTED_GRACE_S

    def _remove_unlisted(self) -> None:
        """Remove the segments found in no list whose trainer has not let them go."""
        unlisted, self._unlisted = self._unlisted, []
        for seg in unlisted:
            if not seg.mm.closed and not seg.is_free():
                seg.unlink()

    @property
    def active(self) -> bool:
        """Whether some rank's trainer is on this host (frames for it use segments)."""
        return bool(self._local)

    def active_for(self, rank: int, mask: int = 1) -> bool:
        """Whether frames for ``rank`` of the group slots of ``mask`` go into segments:
        every one of those trainers is on this host."""
        return all((slot, rank) in self._local for slot in slots_of(mask))

    @staticmethod
    def host_field(rank: int, world: int) -> str:
        """The meta field where ``rank`` of ``world`` publishes its host."""
        return rank_field(MetaField.SHM_HOST, rank, world)

    def refresh(self, client: redis.Redis, *, force: bool = False) -> None:
        """Follow the trainers' published host identities: at most once a second, but
        before every batch during the second after a join while a rank has published
        none (a join can fall between a trainer's claim or resume and its publish)."""
        if self.identity is None:
            return
        now = time.monotonic()
        if self._unlisted and now >= self._unlisted_at:
            self._remove_unlisted()
        if not force and now - self._checked < REFRESH_S and now >= self._eager_until:
            return
        self._checked = now
        readers = self._readers()
        hosts, prefetches = self._read_readers(client, readers)
        if all(v is not None for v in hosts):
            self._eager_until = 0.0  # every reader's trainer has said where it is
        local = tuple(who for who, v in zip(readers, hosts, strict=True) if self._is_here(v))
        if self._fixed is None:
            # Room for what each reader on this host can hold (pool_size), and our own
            # two (a segment several groups share counts once per group: an upper bound).
            cap = self._position.list_cap
            held = sum(
                pool_size(cap, _reader_prefetch(prefetches[readers.index(who)]), 1) - OUTSIDE
                for who in local
            )
            self.pool.max_segments = held + OUTSIDE
        if local != self._local:
            self._switch(local)

    def _readers(self) -> list[tuple[int, int]]:
        """Every (group slot, rank) reading the run."""
        slots = max(self._position.groups, 1)
        return [(s, r) for s in range(slots) for r in range(self._world_of(s))]

    def _world_of(self, slot: int) -> int:
        """The ranks group slot ``slot`` reads with (at least one)."""
        return max(1, self._position.world_of(slot))

    def _read_readers(
        self, client: redis.Redis, readers: list[tuple[int, int]]
    ) -> tuple[list[Any], list[Any]]:
        """Each reader's published host and reader prefetch (one HMGET of meta)."""
        w = self._world_of
        fields = [reader_field(MetaField.SHM_HOST, s, r, w(s)) for s, r in readers]
        fields += [reader_field(MetaField.SHM_LOOKAHEAD, s, r, w(s)) for s, r in readers]
        values = call(lambda: client.hmget(self.keys.meta, fields), "reading meta")
        return values[: len(readers)], values[len(readers) :]

    def _is_here(self, published: object) -> bool:
        """Whether a rank's published host is this one."""
        return isinstance(published, bytes) and published.decode() == self.identity

    def _switch(self, local: tuple[tuple[int, int], ...]) -> None:
        """Frames for the readers ``local`` use segments from now on (logged)."""
        where = f"shared memory in {self.shm_dir}" if local else "Redis"
        if self._position.world > 1 and local:
            ranks = sorted({r for _, r in local})
            where += f" for ranks {', '.join(map(str, ranks))} (Redis for the others)"
        if self._position.groups > 1 and local:
            slots = sorted({s for s, _ in local})
            where += f" for group slots {', '.join(map(str, slots))}"
        log.info("producer %s: frames now travel through %s", self.producer, where)
        self._local = local

    def rerouted(self) -> None:
        """A push was refused with REROUTE (the rank's published host changed): count
        it, and read the hosts at the next :meth:`refresh`."""
        self.reroutes += 1
        self.recheck()

    def recheck(self) -> None:
        """Look at the trainer's host at the next :meth:`refresh` (after waiting at the
        cap: a trainer that just arrived publishes its host before its first pop)."""
        self._checked = -REFRESH_S

    def encode(
        self,
        header: codec.FrameHeader,
        data: Sequence[Any],
        *,
        checksum: bool = False,
        max_frame_bytes: int | None = None,
        rank: int = 0,
        mask: int = 1,
    ) -> Pieces | ShmFrame:
        """Encode a frame for ``rank`` of the group slots of ``mask``: into a segment
        when all their trainers are on this host and one is free, else as pieces for
        Redis. Arguments and errors as :func:`codec.encode_frame`."""
        if self.active_for(rank, mask):
            frame = self._encode_shm(header, data, checksum, max_frame_bytes, mask)
            if frame is not None:
                return frame
        return codec.encode_frame_pieces(
            header, data, checksum=checksum, max_frame_bytes=max_frame_bytes
        )

    def _encode_shm(
        self,
        header: codec.FrameHeader,
        data: Sequence[Any],
        checksum: bool,
        max_frame_bytes: int | None,
        mask: int = 1,
    ) -> ShmFrame | None:
        got: list[Segment | str] = []

        def alloc(nbytes: int) -> memoryview | None:
            got.append(self._acquire(nbytes))
            return got[0].body(nbytes) if isinstance(got[0], Segment) else None

        result = codec.encode_frame_into(
            alloc, header, data, checksum=checksum, max_frame_bytes=max_frame_bytes
        )
        segment = got[0] if got else None
        if result is None or not isinstance(segment, Segment):
            self.fallbacks += 1
            if segment == FULL and not self._warned:
                self._warned = True
                log.warning(
                    "producer %s: no room in %s for another segment (%s); frames that do "
                    "not fit go through Redis",
                    self.producer,
                    self.shm_dir,
                    self.pool.last_error,
                )
            return None
        nbytes = result[0]
        gen = segment.commit(nbytes, mask)
        self.shm_frames += 1
        host = self.identity or ""
        element = encode_descriptor(segment.name, gen, nbytes, host)
        return ShmFrame(element, nbytes, segment, gen, host)

    def _acquire(self, nbytes: int) -> Segment | str:
        """A segment from the pool, waiting a little for one the trainer lets go."""
        got = self.pool.acquire(nbytes)
        if got == NO_ROOM and self._patient:
            self.no_room_waits += 1
            deadline = time.monotonic() + NO_ROOM_WAIT_S
            while got == NO_ROOM and time.monotonic() < deadline:
                time.sleep(NO_ROOM_POLL_S)
                got = self.pool.acquire(nbytes)
        self._patient = got != NO_ROOM
        return got

    def close(self, finished: bool) -> None:
        """The producer leaves: remove its segments (see :meth:`SegmentPool.close`)."""
        self.pool.close(finished)
