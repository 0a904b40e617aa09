"""The frame's kinds and the header rules the encoder and the decoder share; the
reference element of a frame stored under its own key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batchq.errors import ConfigError, FrameError
from batchq.wire import codec, frame
from batchq.wire.codec import FrameHeader, encode_frame, is_frame
from batchq.wire.frame import (
    REF_MAGIC,
    FrameKind,
    decode_ref,
    encode_ref,
    header_problem,
    is_int,
    is_ref,
)


def _header(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "run": "r", "ep": 0, "sh": 1, "k": 0, "g": 3, "pid": "p", "last": False, "src": ["x"],
    }  # fmt: skip
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


def test_a_valid_header_has_no_problem() -> None:
    assert header_problem(FrameKind.BATCH, _header()) is None
    assert header_problem(FrameKind.BATCH, _header(last=True, n=2, t=1.5)) is None
    assert header_problem(FrameKind.END, _header(src=[], last=True, n=0)) is None
    assert header_problem(FrameKind.ERROR, _header(src=[], last=True, n=0, err="tb")) is None


@pytest.mark.parametrize(
    ("kind", "changes", "names"),
    [
        (FrameKind.BATCH, {"ep": -1}, "'ep' (epoch) is -1, expected >= 0"),
        (FrameKind.BATCH, {"k": True}, "'k' (k)"),
        (FrameKind.BATCH, {"g": -2}, "expected >= -1"),
        (FrameKind.BATCH, {"run": 5}, "'run' (run id)"),
        (FrameKind.BATCH, {"src": ["x", "x"]}, "unique strs"),
        (FrameKind.BATCH, {"last": True}, "'n' (count)"),
        (FrameKind.BATCH, {"n": 2}, "'n' (count)"),
        (FrameKind.END, {"last": True, "n": 0}, "carry no data"),
        (FrameKind.ERROR, {"src": [], "last": True, "n": 0}, "need the traceback"),
        (FrameKind.BATCH, {"err": "tb"}, "belong to ERROR frames"),
        (FrameKind.BATCH, {"t": "now"}, "'t' (produced_at)"),
    ],
)
def test_each_broken_field_is_named(kind: FrameKind, changes: dict[str, Any], names: str) -> None:
    problem = header_problem(kind, _header(**changes))
    assert problem is not None and names in problem


def test_is_int_refuses_bools_and_values_below_the_bound() -> None:
    assert is_int(0, 0) and is_int(-1, -1)
    assert not is_int(True, 0) and not is_int(-1, 0) and not is_int(1.0, 0)


def test_the_codec_re_exports_the_frame_types() -> None:
    assert codec.Frame is frame.Frame and codec.FrameKind is frame.FrameKind
    assert codec.FrameHeader is frame.FrameHeader and codec.MAGIC == frame.MAGIC == b"BQF"


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
