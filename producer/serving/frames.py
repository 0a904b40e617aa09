"""The frames a producer makes of a shard, and what they carry that never changes while
it serves: one :class:`PushSettings` (made by the Producer, handed to its pusher), a
batch's header, and the END or ERROR frame that closes a shard (how a batch's arrays are
encoded, into shared memory or pieces for Redis, is :mod:`producer.serving.transport`'s)."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

from batchq.protocol.keys import QueueKeys
from batchq.wire import codec

__all__ = ["INLINE_MAX_BYTES", "PushSettings", "batch_header", "end_frame"]

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


def batch_header(
    settings: PushSettings,
    run: str,
    epoch: int,
    shard: int,
    k: int,
    last: bool,
    shard_batches: int | None,
    params_version: int = 0,
) -> codec.FrameHeader:
    """The header of batch ``k`` of ``shard`` (its global number where the plan knows
    the batches per shard, ``shard_batches``; the params log's version it was built
    with)."""
    return codec.FrameHeader(
        codec.FrameKind.BATCH,
        run=run,
        epoch=epoch,
        shard=shard,
        k=k,
        g=-1 if shard_batches is None else shard_batches * shard + k,
        producer=settings.producer,
        sources=settings.sources,
        last=last,
        count=k + 1 if last else None,
        produced_at=time.time(),
        params_version=params_version,
    )


def end_frame(
    producer: str,
    run: str,
    epoch: int,
    shard: int,
    count: int,
    error: Exception | None = None,
    params_version: int = 0,
) -> memoryview:
    """The shard's end after ``count`` batches: an END frame, or with ``error`` the ERROR
    frame carrying the pipeline's traceback (``params_version``: the params log's
    version in effect there)."""
    kind = codec.FrameKind.END
    why: dict[str, Any] = {}
    if error is not None:
        kind = codec.FrameKind.ERROR
        why = {
            "error": "".join(traceback.format_exception(error)),
            "error_name": type(error).__name__,
        }
    header = codec.FrameHeader(
        kind, run=run, epoch=epoch, shard=shard, k=count, producer=producer, last=True,
        count=count, params_version=params_version, **why,
    )  # fmt: skip
    return codec.encode_frame(header)
