"""A single trainer that stops without finishing (``close()``) gives back what it popped
and did not hand out, so that a trainer resumed from the state saved there reads on at
once (docs/design.md "Resume": a detached run is taken over as it is).

The frames the reader holds are given back as they came where they still are: a batch
in a producer's shared-memory segment as its descriptor, handed over (the segment is
released by the trainer that pops it, not by this one:
:meth:`consumer.reader.shm_frames.TrainerShm.hand_over`, before the call, taken back
only where the script refused); any other (inline, from a key of frames stored by
reference, a copy) encoded again, as a frame inside the list.
They are pushed back to the list's popping end, the next to hand out last (so it is
popped first), by detach.lua, which also marks the run as detached at the stream's
position: a digest of its ``state_dict()`` and its shared-memory host. A resume from
that state (taken right before ``close()``) on the same host finds every batch it has
not had in the list, with the producers' leases and the cursor standing, and changes
nothing; a resume from any other state starts a new run as before.

Nothing is given back (and the run is not marked) where a frame could not be given back
as it was popped: the reader's preparation changed it (a subset of the sources, a cast,
a hook: pinned copies, a user's), a held shard failed (an ERROR frame), a held frame is
of an earlier run (Redis lost the queue), or the trainer reads as a rank or a group, or
a striped queue. Batches a wrapper took and has not handed on (a device prefetch) come
first, given by the wrapper's close (``taken``); its state holds them back, and so does
the mark's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from batchq.client.connection import call
from batchq.errors import BatchQueueError
from batchq.protocol import trainer_scripts
from batchq.protocol.words import Status
from batchq.wire.codec import Frame, FrameHeader, encode_frame
from consumer.checkpoint import position_digest
from consumer.reader.buffer import Buffer
from consumer.reader.shm_frames import TrainerShm
from consumer.session import Session

__all__ = ["CHUNK_FRAMES", "detach"]

log = logging.getLogger(__name__)

#: Frames given back per call: the encoded copies a call holds at once (a look-ahead
#: can hold many more frames than the hwm while the next one in order is missing).
CHUNK_FRAMES = 16


def detach(
    session: Session,
    client: redis.Redis,
    buffer: Buffer,
    *,
    state: Mapping[str, Any],
    host: str | None,
    exact: bool,
    shm: TrainerShm | None = None,
    taken: Sequence[Frame] = (),
) -> int:
    """Give back the frames ``buffer`` holds and mark the run detached at ``state``.

    Never raises: a detach that cannot be made leaves the run unmarked (a resume then
    starts a new run, as after a crash), and the stream's close goes on.

    Args:
        session: the trainer's session (claimed; a single trainer of the default group).
        client: the stream's client.
        buffer: the stream's buffer, its readers stopped.
        state: the stream's ``state_dict()`` now.
        host: this trainer's shared-memory host identity (None: it takes nothing by
            shared memory): part of the mark, so that only a trainer of the same host,
            which can map the descriptors listed for this one, takes the run over.
        exact: the held frames hold the values they were decoded with (the reader's
            preparation kept them: :meth:`FramePrep.keeps_frames`), on a single stripe.
        shm: the trainer's shared memory (None: everything is encoded again), whose
            batches still in their segments are given back as their descriptors.
        taken: frames a wrapper took from the stream and did not hand on, in the order
            taken (before every frame the buffer holds); ``state`` holds them back.

    Returns:
        The frames given back: the run is marked (also where none was held), but where
        the detach was refused (0, logged).
    """
    run, _ = session.position()
    held = _held(session, buffer, run, taken) if exact else None
    if held is None:
        return 0
    position, given = position_digest(state, host), 0
    try:
        # The latest frames first, a chunk a call (the trainer's memory and the call stay
        # bounded whatever the look-ahead held); the call with the next frame to hand
        # out marks the run. A list given back in part is unmarked: any resume drops it.
        # Nothing held: one call with no frame still marks the run.
        for end in range(len(held), 0, -CHUNK_FRAMES) or [0]:
            chunk = held[max(0, end - CHUNK_FRAMES) : end]
            got = _give_back(
                session, client, run, position, chunk, final=end <= CHUNK_FRAMES, shm=shm
            )
            if got < 0:
                return 0
            given += got
    except (BatchQueueError, redis.RedisError) as e:
        # A value the codec cannot give back as it is; Redis refusing (an ACL without
        # RPUSH, maxmemory), or gone.
        log.warning("%s: the frames held were not given back: %s", session.what, e)
        return 0
    log.info("%s: detached, %d frames given back", session.what, given)
    return given


def _give_back(
    session: Session,
    client: redis.Redis,
    run: str,
    position: str,
    chunk: list[Frame],
    *,
    final: bool,
    shm: TrainerShm | None,
) -> int:
    """One detach.lua call: ``chunk`` (in plan order) given back, each frame as its
    descriptor where its batch is still in its segment, else encoded again; the frames
    given back, or -1 where the script refused (the claim or the run lost). One try: a
    retry after a lost reply would give the frames back twice. The batches given back
    as descriptors are handed over before the call and taken back only where the script
    refused: after a lost reply (the frames may be in the list, the run marked) the
    segments stay held for the trainer that pops them, never released under them (a new
    run removes them)."""
    frames = list(reversed(chunk))
    descriptors = shm.descriptors(frames) if shm is not None else [None] * len(frames)
    encoded = [
        encode_frame(_header(f), f.data) if d is None else d[0]
        for f, d in zip(frames, descriptors, strict=True)
    ]
    handed = [d[1] for d in descriptors if d is not None]
    if shm is not None:
        shm.hand_over(handed)
    reply = call(
        lambda: trainer_scripts.detach(
            client, session.keys, incarnation=session.incarnation, run=run,
            token=session.token, position=position, frames=encoded, final=final,
        ),
        f"giving back the frames held ({session.what})",
        client,
    )  # fmt: skip
    if reply.status != Status.OK:
        if shm is not None:
            shm.hand_over(handed, handed=False)
        return -1
    return reply.first


def _held(session: Session, buffer: Buffer, run: str, taken: Sequence[Frame]) -> list[Frame] | None:
    """The frames to give back (``taken``, then the buffer's), in plan order; None where
    none may be: not a single claimed trainer of the default group, a held ERROR frame,
    or a frame of another run than ``run`` (received before Redis lost the queue and
    the run was made again, the reader's recovery: the new run's ledger counts it as
    had, so given back it would be dropped and never built again)."""
    if not session.claimed or session.world != 1 or session.grouped:
        return None
    held = buffer.held_frames()
    if held is None:
        return None
    held = [*taken, *held]
    if any(f.run != run for f in held):
        return None
    return held


def _header(frame: Frame) -> FrameHeader:
    """The header a frame was decoded from (its checksum, if any, is not kept)."""
    return FrameHeader(
        kind=frame.kind, run=frame.run, epoch=frame.epoch, shard=frame.shard, k=frame.k,
        producer=frame.producer, sources=frame.sources, g=frame.g, last=frame.last,
        count=frame.count, error=frame.error, error_name=frame.error_name,
        produced_at=frame.produced_at, params_version=frame.params_version,
    )  # fmt: skip
