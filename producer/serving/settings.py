"""What a producer's pushes carry that never changes while it serves: one
:class:`PushSettings`, made by the Producer and handed to its pusher."""

from __future__ import annotations

from dataclasses import dataclass

from batchq.protocol.keys import QueueKeys

__all__ = ["INLINE_MAX_BYTES", "PushSettings"]

# Large frames travel by reference (a plain SET, then the capped-push script gets only the
# key's name): a value passed through Lua is copied twice more. bench/frame_path.py, push
# + pop against plain LPUSH/RPOP: inline 0.81/0.88/0.72/0.76 and by reference
# 0.61/0.76/0.71/0.91 of raw at 64 KiB/256 KiB/512 KiB/1.5 MiB (docs/design.md).
INLINE_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class PushSettings:
    """A producer's fixed push settings (the Producer's arguments of the same names).

    Attributes:
        keys: the queue's keys.
        producer: the producer's id.
        sources: the names of the values a batch holds, in order.
        checksum: add a CRC32 of the buffers to every frame.
        max_frame_bytes: refuse to push a batch larger than this (None: no limit).
        inline_max_bytes: frames larger than this travel by reference.
        heartbeat_ttl_ms: a producer silent for this long is declared dead.
        max_attempts: a shard whose pipeline raised this many times is reported.
        stripe: the stripe the producer serves (``keys`` are its) of the ``stripes`` of
            a striped queue (:mod:`batchq.protocol.stripes`).
        stripes: how many the queue has.
    """

    keys: QueueKeys
    producer: str
    sources: tuple[str, ...]
    checksum: bool
    max_frame_bytes: int | None
    inline_max_bytes: int
    heartbeat_ttl_ms: int
    max_attempts: int
    stripe: int = 0
    stripes: int = 1
