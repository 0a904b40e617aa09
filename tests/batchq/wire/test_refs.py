"""batchq.wire.refs: the reference element of a frame stored under its own key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batchq.errors import ConfigError, FrameError
from batchq.wire.codec import FrameHeader, FrameKind, encode_frame, is_frame
from batchq.wire.refs import REF_MAGIC, decode_ref, encode_ref, is_ref

VALID = bytes(
    encode_frame(
        FrameHeader(FrameKind.BATCH, run="r", epoch=0, shard=0, k=0, producer="p",
                    sources=("x",), last=True, count=1),
        (np.arange(4),),
    )
)  # fmt: skip


@pytest.mark.parametrize("key", ["bq:q:frame:1:2:3", "bq:q:frame:ünï", "bq:q:" + "x" * 500])
def test_ref_round_trip(key: str) -> None:
    elem = encode_ref(key)
    assert elem.startswith(REF_MAGIC)
    assert is_ref(elem) and not is_frame(elem)
    assert decode_ref(elem, "bq:q:") == key
    assert decode_ref(bytearray(elem), "bq:q:") == key


def test_is_frame_and_is_ref_are_cheap_prefix_checks() -> None:
    assert is_frame(VALID) and not is_ref(VALID)
    assert is_frame(bytearray(VALID)) and is_frame(memoryview(VALID))
    for other in (b"", b"BQ", b"xyz", "BQF...", None, 5):
        assert not is_frame(other) and not is_ref(other)


@pytest.mark.parametrize(
    "elem",
    [
        b"",
        b"BQR",
        b"BQR\x02bq:q:k",  # wrong ref version
        VALID,
        REF_MAGIC,  # empty key
        REF_MAGIC + b"\xff\xfe",  # not utf-8
        REF_MAGIC + b"other:q:k",  # another queue's key
        REF_MAGIC + b"bq:q:a b",
        REF_MAGIC + b"bq:q:a\tb",
        REF_MAGIC + b"bq:q:a\nb",
        REF_MAGIC + b"bq:q:a\x00b",
        REF_MAGIC + b"bq:q:a\x7fb",
        REF_MAGIC + "bq:q:a\u2028b".encode(),
        REF_MAGIC + "bq:q:a\u00a0b".encode(),
        REF_MAGIC + b"bq:q:" + b"x" * 2000,
    ],
)
def test_bad_refs(elem: bytes) -> None:
    with pytest.raises(FrameError) as info:
        decode_ref(elem, "bq:q:")
    assert info.value.reason == "bad_ref"


@pytest.mark.parametrize("key", ["", "a b", "a\nb", "a\x00b", 5, "x" * 2000])
def test_encode_ref_rejects_bad_keys(key: Any) -> None:
    with pytest.raises(ConfigError):
        encode_ref(key)
