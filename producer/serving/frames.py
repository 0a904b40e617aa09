"""The frames a producer makes of a shard: a batch's header, and the END or ERROR frame
that closes a shard (how a batch's arrays are encoded, into shared memory or pieces for
Redis, is :mod:`producer.serving.transport`'s)."""

from __future__ import annotations

import time
import traceback
from typing import Any

from batchq.wire import codec
from producer.serving.settings import PushSettings

__all__ = ["batch_header", "end_frame"]


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
