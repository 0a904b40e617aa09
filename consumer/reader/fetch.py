"""The trainer's reader resolves what it popped into frame bytes: inline frames as they
are, frames stored by reference fetched (straight into buffers of their own), frames in
shared memory mapped; what cannot be resolved is a bad frame (the reader's dead list).

Frames stored by reference are received into buffers the trainer owns. redis-py hands a
reply over as an immutable ``bytes`` object, so an array over it can only be writable
after a copy. The reader's pipelined ``GETDEL`` commands go through the one path
commands take (:func:`batchq.protocol.calls.round_trip`), each reply read straight from
the socket into a fresh, uninitialised numpy buffer of that frame's size
(:func:`batchq.client.redis_internals.read_bulk_into`): one buffer per frame, never
pooled, so the arrays decoded over it are writable without a copy and no later frame can
write into them. Where the socket cannot be read that way (TLS, fakeredis in unit tests)
each reply is copied once into a buffer of its own.

Frames stored once for several groups (:mod:`batchq.protocol.groups`): a frame push.lua
listed for k > 1 groups is read by each group's trainer and deleted by the last: the
reader GETs each frame (into a buffer of its own, as :func:`getdel_into` does with
GETDEL) and, in the same round trip, releases them (release.lua). Redis runs the
commands in order, so the bytes are read before the count drops; a key without a count
(one reader) goes at its release like a GETDEL. A trainer killed between its pop and
this round trip leaves the frames' counts up: they go when the run ends (every frame of
the queue is deleted then).

**A group that finished before the others** lets go of what its list still holds: a
frame stored by reference is deleted by its last reader's release, and a shared-memory
segment is reused once every group it went to released it. A rank of a group that
finished (``close(finished=True)``) is no longer a target of any push (push.lua), but
its list may still hold frames pushed before (the window it read ahead):
:func:`drain_group` pops them and releases each, so that the other groups' frames and
segments are not held until the run ends. A trainer killed before it drains leaves that
to the run's end (every frame and segment of the queue goes then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import call, is_wrong_type, redis_errors, retrying
from batchq.client.redis_internals import BulkReply, read_bulk_into
from batchq.errors import ConnectionLost, FrameError
from batchq.protocol import trainer_scripts
from batchq.protocol.calls import execute_pipeline, round_trip
from batchq.protocol.keys import QueueKeys
from batchq.wire.frame import decode_ref, is_ref
from batchq.wire.shm import is_descriptor

__all__ = [
    "DRAIN_CHUNK",
    "Fetched",
    "Fetcher",
    "Reply",
    "drain_group",
    "get_and_release",
    "getdel_into",
    "ref_error",
    "release",
]

log = logging.getLogger(__name__)

# One popped element resolved: (its frame's bytes or None when it is a bad frame, the
# list element itself, the key of a frame stored by reference or '').
Fetched = tuple[Any, bytes, str]


class Fetcher:
    """Resolving popped elements for one reader.

    Args:
        client: the reader's client.
        keys: the queue's keys.
        resolve: a shared-memory descriptor's frame bytes (the trainer's shared memory,
            :meth:`consumer.reader.shm_frames.TrainerShm.resolve`; None: a duplicate
            already released).
        max_frame_bytes: referenced frames above this are dropped unfetched.
        dead: records a bad element with its reason (and applies the trainer's policy:
            it may raise).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        resolve: Callable[[bytes], Any],
        max_frame_bytes: int | None,
        dead: Callable[[bytes, FrameError], None],
    ) -> None:
        self.client = client
        self.keys = keys
        self.resolve = resolve
        self.max_frame_bytes = max_frame_bytes
        self._dead = dead
        # A run read by several groups: frames stored by reference may be stored once
        # for all, so they are read and released (get_and_release), never GETDELed.
        self.shared = False

    def fetch(self, elements: list[bytes]) -> list[Fetched]:
        """Resolve references and shared-memory descriptors: (frame or None, the list
        element, the ref key or '')."""
        stored: list[tuple[int, str]] = []
        out: list[Fetched] = []
        for i, element in enumerate(elements):
            if is_descriptor(element):
                try:  # a read-only array over the segment, owning the batch
                    out.append((self.resolve(element), element, ""))
                except FrameError as e:
                    self._dead(element, e)
                    out.append((None, element, ""))
            elif is_ref(element):
                try:
                    key = decode_ref(element, self.keys.frame_prefix)
                except FrameError as e:
                    self._dead(element, e)
                    out.append((None, element, ""))
                    continue
                stored.append((i, key))
                out.append((None, element, key))
            else:
                out.append((element, element, ""))
        if stored and self.max_frame_bytes is not None:
            stored = self._refuse_oversized(stored, out)
        if stored:
            self._receive(stored, out)
        return out

    def _receive(self, stored: list[tuple[int, str]], out: list[Fetched]) -> None:
        """Fetch the referenced frames into their places in ``out``.

        Straight from the socket into buffers the trainer owns: no copy in redis-py (half
        the trainer's CPU per 12.6 MB frame, bench/torch_loader.py), and writable arrays
        need none either. A key of another type answers an error in its place (a bad
        frame), not for the whole round.
        """
        names = [k for _, k in stored]
        if self.shared:
            replies: list[Any] = call(
                lambda: get_and_release(self.client, self.keys, names), "fetching frames"
            )
        else:
            replies = call(
                lambda: getdel_into(self.client, names, raise_on_error=False), "fetching frames"
            )
        for (i, key), value in zip(stored, replies, strict=True):
            element = out[i][1]
            if isinstance(value, Exception):
                # Another type under a frame's name (a foreign writer): a bad frame.
                self._dead(element, ref_error(key, value))
                value = None
            elif value is None:
                self._dead(element, FrameError("missing_ref", f"frame key {key!r} is gone"))
            out[i] = (value, element, key)

    def _refuse_oversized(
        self, stored: list[tuple[int, str]], out: list[Fetched]
    ) -> list[tuple[int, str]]:
        """Drop referenced frames above max_frame_bytes without fetching them."""
        sizes = execute_pipeline(
            self.client, lambda pipe: [pipe.strlen(k) for _, k in stored], raise_on_error=False
        )
        keep = []
        for (i, key), size in zip(stored, sizes, strict=True):
            if isinstance(size, Exception):
                self._dead(out[i][1], ref_error(key, size))
                out[i] = (None, out[i][1], "")
            elif int(size) > (self.max_frame_bytes or 0):
                self._drop_key(key)
                error = FrameError(
                    "too_large",
                    f"frame {key!r} has {size} bytes, above max_frame_bytes="
                    f"{self.max_frame_bytes}; not fetched",
                )
                self._dead(out[i][1], error)
            else:
                keep.append((i, key))
        return keep

    def _drop_key(self, key: str) -> None:
        if self.shared:  # other groups may read it: only this reader's count goes
            call(lambda: release(self.client, self.keys, [key]), "dropping an oversized frame")
            return
        call(lambda: self.client.delete(key), "dropping an oversized frame")


def ref_error(key: str, error: Exception) -> FrameError:
    """The bad frame for a reference whose key could not be read as a string.

    Raises:
        ConnectionLost: the error was the connection's.
    """
    if is_wrong_type(error):
        return FrameError(
            "wrong_type", f"frame key {key!r} holds another Redis type, expected a string"
        )
    if isinstance(error, redis_errors):
        raise ConnectionLost(f"Redis connection lost while fetching {key!r}: {error}") from error
    return FrameError("bad_ref", f"frame key {key!r} could not be read: {error}")


Reply = BulkReply


def getdel_into(
    client: redis.Redis, keys: list[str], *, raise_on_error: bool = True
) -> list[Reply]:
    """GETDEL each key, each value received into a writable buffer of its own.

    Args:
        client: the reader's client.
        keys: the frame keys to fetch and delete.
        raise_on_error: raise the first error Redis answered (after reading every reply);
            False: return it in that key's place (a key of another type, WRONGTYPE).

    Returns:
        One writable byte memoryview per key (None where the key was gone, the error where
        Redis refused and ``raise_on_error`` is False).

    Raises:
        ConnectionLost: the connection failed (it is dropped, never handed back out of
            step with its replies).
        redis.ResponseError: Redis refused a command (after all replies were read).
    """
    if not keys:
        return []
    replies: list[Reply] = round_trip(
        client,
        [("GETDEL", key) for key in keys],
        "fetching frames",
        keep_errors=True,
        readers=[read_bulk_into] * len(keys),
    )
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
    return replies


def get_and_release(client: redis.Redis, keys: QueueKeys, names: list[str]) -> list[BulkReply]:
    """GET each frame key, each value received into a writable buffer of its own, then
    release them all (one round trip).

    Returns:
        One writable byte memoryview per key (None where the key was gone, the error
        where Redis refused: a key of another type).

    Raises:
        ConnectionLost: the connection failed (nothing is released twice: the reader
            does not fetch those elements again).
        redis.ResponseError: Redis refused the release (OOM is not: it deletes).
    """
    if not names:
        return []
    call = trainer_scripts.release_call(keys, names)
    replies = round_trip(
        client,
        [*(("GET", name) for name in names), call.command()],
        "fetching frames",
        keep_errors=True,
        readers=[*([read_bulk_into] * len(names)), None],
    )
    if isinstance(replies[-1], redis.ResponseError):
        raise replies[-1]
    return replies[:-1]


def release(client: redis.Redis, keys: QueueKeys, names: list[str]) -> None:
    """Release frames this reader will not read (refused unfetched: too large)."""
    if names:
        trainer_scripts.release_call(keys, names).run(client)


DRAIN_CHUNK = 256  # elements popped per round trip


def drain_group(
    client: redis.Redis,
    keys: QueueKeys,
    data_key: str,
    release_unread: Callable[[bytes], bool],
    timeout_s: float,
) -> int:
    """Pop everything left in ``data_key`` (a finished group rank's list) and release
    it: references through release.lua, shared-memory descriptors through their
    segments' release words (``release_unread``: the trainer's shared memory's,
    :meth:`consumer.reader.shm_frames.TrainerShm.release_unread`); returns how many
    elements went."""
    drained = 0
    while True:

        def pop() -> Any:
            return client.rpop(data_key, DRAIN_CHUNK)

        elements = retrying(pop, f"draining {data_key}", timeout_s, client=client) or []
        if not elements:
            break
        drained += len(elements)
        names: list[str] = []
        for element in elements:
            if is_descriptor(element):
                release_unread(element)
            elif is_ref(element):
                try:
                    names.append(decode_ref(element, keys.frame_prefix))
                except FrameError:
                    continue  # not this queue's: nothing of ours to release
        if names:
            call = trainer_scripts.release_call(keys, names)

            def release(call: Any = call) -> Any:
                return round_trip(client, [call.command()], "releasing frames")

            retrying(release, f"releasing frames ({keys.queue})", timeout_s, client=client)
    if drained:
        log.info("queue %s: %d element(s) left in %s released", keys.queue, drained, data_key)
    return drained
