"""The codec under faults (issue 11): the checksum covers the header, and dtypes whose
meaning depends on the platform are refused on both sides."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from frame_args import encode_with

from batchq.errors import ConfigError, FrameError
from batchq.wire import codec
from batchq.wire.codec import FrameKind, decode_frame, encode_frame, encode_frame_pieces


def frame(checksum: bool = True, **kw: Any) -> bytes:
    args: dict[str, Any] = dict(
        run="run-1", epoch=2, shard=3, k=4, producer="p0", sources=("x",),
        data=(np.arange(50, dtype="<i4"),), checksum=checksum,
    )  # fmt: skip
    args.update(kw)
    return bytes(encode_with(encode_frame, FrameKind.BATCH, **args))


def header_span(buf: bytes) -> tuple[int, int]:
    hlen = codec.PREFIX.unpack_from(buf)[4]
    return codec.PREFIX.size, codec.PREFIX.size + hlen


def test_a_flipped_header_byte_fails_the_checksum() -> None:
    # Before: the crc covered only the buffer region, so a flipped address decoded.
    buf = frame()
    start, end = header_span(buf)
    value = buf.index(b"\xa2ep") + 3  # the epoch's value byte (a positive fixint)
    assert start < value < end
    flipped = bytearray(buf)
    flipped[value] ^= 0x08
    with pytest.raises(FrameError) as info:
        decode_frame(bytes(flipped))
    assert info.value.reason == "bad_checksum"
    assert decode_frame(bytes(flipped), verify_checksum=False).epoch == 2 ^ 0x08


def test_every_single_bit_flip_is_caught_or_refused() -> None:
    buf = frame()
    rng = np.random.default_rng(11)
    for pos in rng.choice(len(buf), size=200, replace=False):
        bad = bytearray(buf)
        bad[int(pos)] ^= 1 << int(rng.integers(8))
        with pytest.raises(FrameError):
            decode_frame(bytes(bad))


def test_pieces_and_single_buffer_agree_with_the_checksum() -> None:
    kw: dict[str, Any] = dict(
        run="r", epoch=0, shard=1, k=0, producer="p", sources=("a", "b"),
        data=(np.arange(7, dtype="<f4"), np.ones((3, 3), dtype="<u1")), checksum=True,
    )  # fmt: skip
    whole = bytes(encode_with(encode_frame, FrameKind.BATCH, **kw))
    assert bytes(encode_with(encode_frame_pieces, FrameKind.BATCH, **kw)) == whole
    assert decode_frame(whole).k == 0


@pytest.mark.parametrize("dtype", ["<f16", "<c32", ">f16", ">c32"])
def test_platform_dependent_dtypes_are_refused(dtype: str) -> None:
    try:
        value = np.zeros(3, dtype=dtype)
    except TypeError:
        pytest.skip(f"numpy has no {dtype} here")
    with pytest.raises(ConfigError, match="platform"):
        frame(checksum=False, data=(value,))
    # Decoding refuses it too (a frame written by another implementation).
    buf = frame(checksum=False, data=(np.zeros(6, dtype="<f8"),))
    start, end = header_span(buf)
    header = msgpack.unpackb(buf[start:end])
    header["items"][0].update(dtype=dtype, len=3 * np.dtype(dtype).itemsize)
    packed = msgpack.packb(header, use_bin_type=True)
    data_start = codec.align(codec.PREFIX.size + len(packed))
    assert data_start == header["items"][0]["off"]  # the layout is unchanged
    prefix = codec.PREFIX.pack(codec.MAGIC, 1, 1, bytes(3), len(packed))
    forged = (prefix + packed).ljust(data_start, b"\0") + bytes(header["items"][0]["len"])
    with pytest.raises(FrameError) as info:
        decode_frame(forged)
    assert info.value.reason == "bad_dtype" or "dtype" in info.value.detail


def test_longdouble_scalars_are_refused() -> None:
    if np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("longdouble is float64 here")
    with pytest.raises(ConfigError, match="platform"):
        frame(checksum=False, data=(np.longdouble(1) / 3,))
