"""Calling the codec's encoders from one flat set of keyword arguments (parametrized
tests list a frame's fields and options together)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchq.wire.codec import FrameHeader, FrameKind

OPTIONS = ("checksum", "max_frame_bytes", "rank", "mask")


def encode_with(encode: Callable[..., Any], kind: FrameKind | int, **fields: Any) -> Any:
    """``encode(FrameHeader(kind, ...), data, checksum=..., max_frame_bytes=...)`` from
    the flat ``fields``: ``data`` and the options apart, the rest the header's."""
    data = fields.pop("data", ())
    options = {name: fields.pop(name) for name in OPTIONS if name in fields}
    return encode(FrameHeader(kind, **fields), data, **options)  # type: ignore[arg-type]
