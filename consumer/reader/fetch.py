"""The trainer's reader resolves what it popped into frame bytes: inline frames as they
are, frames stored by reference fetched (straight into buffers of their own), frames in
shared memory mapped; what cannot be resolved is a bad frame (the reader's dead list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import call, is_wrong_type, redis_errors
from batchq.errors import ConnectionLost, FrameError
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.keys import QueueKeys
from batchq.wire import refs
from batchq.wire.shm import is_descriptor
from consumer.reader.receive import getdel_into
from consumer.reader.shared_receive import get_and_release, release
from consumer.reader.shm_frames import TrainerShm

__all__ = ["Fetched", "Fetcher", "ref_error"]

# One popped element resolved: (its frame's bytes or None when it is a bad frame, the
# list element itself, the key of a frame stored by reference or '').
Fetched = tuple[Any, bytes, str]


class Fetcher:
    """Resolving popped elements for one reader.

    Args:
        client: the reader's client.
        keys: the queue's keys.
        shm: the trainer's shared memory.
        max_frame_bytes: referenced frames above this are dropped unfetched.
        dead: records a bad element with its reason (and applies the trainer's policy:
            it may raise).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        shm: TrainerShm,
        max_frame_bytes: int | None,
        dead: Callable[[bytes, FrameError], None],
    ) -> None:
        self.client = client
        self.keys = keys
        self.shm = shm
        self.max_frame_bytes = max_frame_bytes
        self._dead = dead
        # A run read by several groups: frames stored by reference may be stored once
        # for all, so they are read and released (shared_receive), never GETDELed.
        self.shared = False

    def fetch(self, elements: list[bytes]) -> list[Fetched]:
        """Resolve references and shared-memory descriptors: (frame or None, the list
        element, the ref key or '')."""
        stored: list[tuple[int, str]] = []
        out: list[Fetched] = []
        for i, element in enumerate(elements):
            if is_descriptor(element):
                try:  # a read-only array over the segment, owning the batch
                    out.append((self.shm.resolve(element), element, ""))
                except FrameError as e:
                    self._dead(element, e)
                    out.append((None, element, ""))
            elif refs.is_ref(element):
                try:
                    key = refs.decode_ref(element, self.keys.frame_prefix)
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
