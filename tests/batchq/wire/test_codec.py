"""Tests of the wire codec (batchq.wire.codec): round trips, zero-copy views, and rejection."""

from __future__ import annotations

import io
import itertools
import math
import pickle
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from frame_args import encode_with
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchq.errors import ConfigError, FrameError
from batchq.wire.codec import (
    MAGIC,
    Frame,
    FrameHeader,
    FrameKind,
    array_or_value,
    decode_frame,
    encode_frame,
    encode_frame_pieces,
)
from batchq.wire.values import pack_header

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- helpers


def enc(*sources_data: tuple[str, Any], **kw: Any) -> bytes:
    """Encode a BATCH frame with default coordinates; returns immutable bytes as Redis does."""
    args: dict[str, Any] = {"run": "run-1", "epoch": 2, "shard": 3, "k": 4, "producer": "p0"}
    args.update(kw)
    kind = args.pop("kind", FrameKind.BATCH)
    sources = tuple(s for s, _ in sources_data)
    data = tuple(d for _, d in sources_data)
    return bytes(encode_with(encode_frame, kind, sources=sources, data=data, **args))


def reaches(arr: np.ndarray, buf: object) -> bool:
    """Whether arr's base chain ends at buf (arr is a view over it)."""
    x: object = arr
    while isinstance(x, np.ndarray):
        x = x.base
    return x is buf


def same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.dtype.str == want.dtype.str  # byte order kept
    assert got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()  # bitwise: NaN, NaT, -0.0


def align(n: int) -> int:
    return -(-n // 64) * 64


def split(frame: bytes) -> tuple[int, dict[str, Any], int, bytes]:
    """Return (kind, header, data_start, buffer region) of a frame."""
    _, _, kind, _, hlen = struct.unpack_from("<3sBB3sI", frame)
    header = msgpack.unpackb(frame[12 : 12 + hlen], raw=False)
    ds = align(12 + hlen)
    return kind, header, ds, frame[ds:]


def descriptors(header: Any) -> Iterator[dict[str, Any]]:
    items = header.get("items") if isinstance(header, dict) else None
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and "off" in item:
            yield item
        elif isinstance(item, dict) and isinstance(item.get("items"), list):
            yield from (e for e in item["items"] if isinstance(e, dict) and "off" in e)


def build(
    header: Any,
    region: bytes = b"",
    *,
    kind: int = 1,
    version: int = 1,
    magic: bytes = MAGIC,
    reserved: bytes = bytes(3),
) -> bytes:
    """Assemble a frame by hand; descriptor offsets in ``header`` are region-relative.

    ``header`` may also be raw bytes, used verbatim as the header.
    """
    if isinstance(header, bytes):
        packed, ds = header, align(12 + len(header))
    else:
        rel = [(d, d["off"]) for d in descriptors(header)]
        ds = 64
        while True:
            for d, off in rel:
                d["off"] = off + ds if isinstance(off, int) and not isinstance(off, bool) else off
            packed = msgpack.packb(header, use_bin_type=True)
            need = align(12 + len(packed))
            if need <= ds:
                break
            ds = need
    out = magic + bytes([version, kind]) + reserved + struct.pack("<I", len(packed)) + packed
    if region:
        out += bytes(ds - len(out)) + region
    return out


def mutate(frame: bytes, fn: Callable[[dict[str, Any]], Any]) -> bytes:
    """Rebuild ``frame`` after ``fn`` edited its header (offsets region-relative)."""
    kind, header, ds, region = split(frame)
    for d in descriptors(header):
        d["off"] -= ds
    replaced = fn(header)
    return build(header if replaced is None else replaced, region, kind=kind)


def reason_of(buf: Any, **kw: Any) -> str:
    with pytest.raises(FrameError) as info:
        decode_frame(buf, **kw)
    assert str(info.value).startswith(f"bad frame ({info.value.reason}): ")
    assert info.value.detail
    return info.value.reason


def decodes_or_frame_error(buf: bytes) -> None:
    """The fuzz contract: a Frame, or FrameError; never another exception."""
    try:
        frame = decode_frame(buf)
    except FrameError:
        return
    assert isinstance(frame, Frame)
    assert len(frame.data) == len(frame.sources)


# --------------------------------------------------------------------------- strategies

DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="?"),
    hnp.datetime64_dtypes(endianness="?"),
    hnp.timedelta64_dtypes(endianness="?"),
    hnp.byte_string_dtypes(endianness="?", max_len=6),
    hnp.unicode_string_dtypes(endianness="?", max_len=6),
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
ARRAYS = DTYPES.flatmap(lambda dt: hnp.arrays(dt, SHAPES))


def _views(arr: np.ndarray) -> st.SearchStrategy[np.ndarray]:
    """The array itself or a non-contiguous view of it."""
    options = [arr, arr.T]
    if arr.ndim:
        options += [arr[::2], arr[::-1], arr[..., ::-2]]
    return st.sampled_from(options)


ARRAY_INPUTS = ARRAYS.flatmap(_views)

VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)

NAMES = st.text(min_size=1, max_size=8)


# --------------------------------------------------------------------------- round trips


@FAST
@given(ARRAY_INPUTS)
def test_array_round_trip_is_a_read_only_view(arr: np.ndarray) -> None:
    buf = enc(("x", arr))
    frame = decode_frame(buf)
    (got,) = frame.data
    same_array(got, arr)
    assert got.flags.writeable is False
    if arr.nbytes:
        assert reaches(got, buf)
        assert np.shares_memory(got, np.frombuffer(buf, np.uint8))
    _, header, ds, _ = split(buf)
    (desc,) = descriptors(header)
    assert desc["off"] % 64 == 0 and desc["off"] >= ds
    hlen = struct.unpack_from("<I", buf, 8)[0]
    assert buf[12 + hlen : ds] == bytes(ds - 12 - hlen)  # zero padding


@FAST
@given(ARRAY_INPUTS)
def test_writable_decode_returns_private_copies(arr: np.ndarray) -> None:
    buf = enc(("x", arr))
    (got,) = decode_frame(buf, writable=True).data
    same_array(got, arr)
    assert got.flags.writeable is True
    assert not np.shares_memory(got, np.frombuffer(buf, np.uint8))


@FAST
@given(st.dictionaries(NAMES, ARRAY_INPUTS | VALUES, min_size=1, max_size=5))
def test_several_sources_keep_their_order(named: dict[str, Any]) -> None:
    buf = enc(*named.items())
    frame = decode_frame(buf)
    assert frame.sources == tuple(named)
    for got, want in zip(frame.data, named.values(), strict=True):
        if isinstance(want, np.ndarray):
            same_array(got, want)
        else:
            assert got == want
    assert frame.as_dict().keys() == named.keys()


@FAST
@given(VALUES)
def test_python_values_round_trip(value: Any) -> None:
    (got,) = decode_frame(enc(("v", value))).data
    assert got == value


def test_tuples_decode_as_lists_and_bytearrays_as_bytes() -> None:
    (got,) = decode_frame(enc(("v", (1, ("a", None), bytearray(b"xy"))))).data
    assert got == [1, ["a", None], b"xy"]


@pytest.mark.parametrize(
    "scalar",
    [
        np.float32(1.5),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.complex128(1 - 2j),
        np.datetime64("2024-01-02T03:04:05", "s"),
        np.timedelta64(7, "ms"),
        np.bytes_(b"ab"),
        np.str_("héllo"),
    ],
)
def test_numpy_scalars_round_trip_as_scalars(scalar: np.generic) -> None:
    (got,) = decode_frame(enc(("s", scalar))).data
    assert type(got) is type(scalar)
    assert got.dtype == scalar.dtype and got.tobytes() == scalar.tobytes()


def test_zero_d_and_zero_size_arrays() -> None:
    data = [
        np.array(3.25),
        np.zeros((0,), "<i8"),
        np.zeros((3, 0, 2), ">f4"),
        np.zeros((0, 0), "U3"),
    ]
    frame = decode_frame(enc(*((f"s{i}", a) for i, a in enumerate(data))))
    for got, want in zip(frame.data, data, strict=True):
        same_array(got, want)
        assert got.flags.writeable is False


def test_non_native_and_odd_dtypes_round_trip() -> None:
    data = [
        np.arange(6, dtype=">f2").reshape(2, 3),
        np.array([np.datetime64("NaT"), np.datetime64("2020-01-01")], ">M8[10s]"),
        np.array([b"ab", b""], "S2"),
        np.array(["ü", "xyz"], ">U3"),
        np.array([np.nan, -0.0], "<f8"),
        np.arange(4, dtype=">c16"),
    ]
    frame = decode_frame(enc(*((f"s{i}", a) for i, a in enumerate(data))))
    for got, want in zip(frame.data, data, strict=True):
        same_array(got, want)


def _ragged(lengths: list[int], dtype: str) -> np.ndarray:
    out = np.empty(len(lengths), dtype=object)
    for i, n in enumerate(lengths):
        out[i] = np.arange(n).astype(dtype)
    return out


@FAST
@given(
    st.lists(st.integers(0, 7), max_size=6),
    st.sampled_from(["<i4", ">i8", "<f2", "u1", "<U2"]),
)
def test_object_arrays_of_ragged_arrays_round_trip(lengths: list[int], dtype: str) -> None:
    ragged = _ragged(lengths, dtype)
    buf = enc(("features", ragged), ("targets", np.arange(len(lengths))))
    got = decode_frame(buf).data[0]
    assert got.dtype == object and got.shape == ragged.shape
    for g, w in zip(got, ragged, strict=True):
        same_array(g, w)
        assert g.flags.writeable is False
        if w.nbytes:
            assert reaches(g, buf)
    for g in decode_frame(buf, writable=True).data[0]:
        assert g.flags.writeable is True


def test_object_arrays_mix_arrays_values_and_scalars() -> None:
    obj = np.empty((2, 2), dtype=object)
    obj[0, 0] = np.arange(3)
    obj[0, 1] = "text"
    obj[1, 0] = [1, [2, None], {"k": b"v"}]
    obj[1, 1] = np.float64(2.5)
    zero_d = np.empty((), dtype=object)
    zero_d[()] = np.ones((2, 2), ">u2")
    got, got0 = decode_frame(enc(("o", obj), ("z", zero_d))).data
    assert got.shape == (2, 2) and got.dtype == object
    same_array(got[0, 0], obj[0, 0])
    assert got[0, 1] == "text"
    assert got[1, 0] == [1, [2, None], {"k": b"v"}]
    assert type(got[1, 1]) is np.float64 and got[1, 1] == 2.5
    assert got0.shape == () and got0.dtype == object
    same_array(got0[()], zero_d[()])


def test_end_frame_round_trip() -> None:
    buf = enc(kind=FrameKind.END, k=9, count=9, g=41, produced_at=123.5)
    frame = decode_frame(buf)
    assert frame.kind is FrameKind.END
    assert (frame.run, frame.epoch, frame.shard, frame.k, frame.g) == ("run-1", 2, 3, 9, 41)
    assert frame.producer == "p0" and frame.last is True and frame.count == 9
    assert frame.sources == () and frame.data == () and frame.error is None
    assert frame.nbytes == len(buf) and frame.produced_at == 123.5


def test_error_frame_round_trip() -> None:
    tb = 'Traceback (most recent call last):\n  File "x.py"\nValueError: ünïcode\n'
    frame = decode_frame(enc(kind=FrameKind.ERROR, error=tb, error_name="ValueError"))
    assert frame.kind is FrameKind.ERROR
    assert frame.error == tb and frame.error_name == "ValueError"
    assert frame.last is False and frame.count is None and frame.data == ()


def test_batch_header_fields_round_trip() -> None:
    buf = enc(("x", np.arange(3)), g=17, last=True, count=5, produced_at=1.25)
    frame = decode_frame(buf)
    assert frame.kind is FrameKind.BATCH
    assert (frame.g, frame.last, frame.count, frame.produced_at) == (17, True, 5, 1.25)
    plain = decode_frame(enc(("x", np.arange(3))))
    assert (plain.g, plain.last, plain.count, plain.produced_at) == (-1, False, None, None)
    assert plain.error is None and plain.error_name is None


def test_bytearray_and_memoryview_input() -> None:
    arr = np.arange(12, dtype="<i4").reshape(3, 4)
    header = FrameHeader(
        FrameKind.BATCH, run="r", epoch=0, shard=0, k=0, producer="p", sources=("a",)
    )
    raw = encode_frame(header, (arr,))
    assert isinstance(raw, memoryview) and raw.nbytes == len(bytes(raw))
    for buf in (raw, bytearray(raw), memoryview(bytes(raw))):
        (got,) = decode_frame(buf).data
        same_array(got, arr)
        assert got.flags.writeable is False
    with pytest.raises(ConfigError, match="decode_responses"):
        decode_frame(bytes(raw).decode("latin-1"))  # type: ignore[arg-type]


def test_encode_zeroes_every_gap() -> None:
    # The buffer is allocated uninitialised: padding must still be zeros (no stale data).
    data = [np.full(3, 0xFF, dtype="u1"), np.full(5, -1, dtype="<i8")]
    for _ in range(3):
        buf = enc(*((f"s{i}", a) for i, a in enumerate(data)))
        _, header, ds, _ = split(buf)
        descs = list(descriptors(header))
        hlen = struct.unpack_from("<I", buf, 8)[0]
        gaps = [buf[12 + hlen : ds], buf[descs[-1]["off"] + descs[-1]["len"] :]]
        gaps += [buf[d["off"] + d["len"] : n["off"]] for d, n in itertools.pairwise(descs)]
        assert all(set(g) <= {0} for g in gaps)


def test_encode_is_one_buffer_with_aligned_arrays() -> None:
    data = [np.arange(5, dtype="u1"), np.zeros(0), np.arange(70, dtype="<f8"), np.array(1)]
    buf = enc(*((f"s{i}", a) for i, a in enumerate(data)), checksum=True)
    _, header, ds, _ = split(buf)
    offs = [d["off"] for d in descriptors(header)]
    assert offs == sorted(offs) and all(o % 64 == 0 and o >= ds for o in offs)
    assert len(buf) == offs[-1] + data[-1].nbytes


# --------------------------------------------------------------------------- checksum


def test_checksum_detects_a_flipped_buffer_byte() -> None:
    arr = np.arange(100, dtype="<i2")
    buf = bytearray(enc(("x", arr), checksum=True))
    assert "crc" in split(bytes(buf))[1]
    same_array(decode_frame(bytes(buf)).data[0], arr)
    _, _, ds, _ = split(bytes(buf))
    for pos in (ds, ds + 101, len(buf) - 1):
        bad = bytearray(buf)
        bad[pos] ^= 0x01
        assert reason_of(bytes(bad)) == "bad_checksum"
        decode_frame(bytes(bad), verify_checksum=False)  # the caller may opt out


def test_the_checksum_is_zlib_s_crc32_of_the_frame_its_own_bytes_read_as_zeros() -> None:
    # The format says zlib's crc32; the codec computes it with ISA-L's where installed.
    buf = enc(("x", np.arange(70_000, dtype="<i4")), ("v", {"a": 1}), checksum=True)
    crc = split(buf)[1]["crc"]
    end = buf.index(b"\xce" + crc.to_bytes(4, "big")) + 5
    assert zlib.crc32(buf[: end - 4] + bytes(4) + buf[end:]) == crc


@pytest.mark.parametrize("checksum", [False, True])
def test_pieces_of_a_frame_ending_in_empty_arrays_hold_its_every_byte(checksum: bool) -> None:
    # The empty arrays' offsets pad the frame past the last bytes an array holds: the
    # pieces carry that padding, so they add up to the frame (a reviewer found a cache
    # entry ending in an empty array read back shifted, its crc failing).
    header = FrameHeader(
        kind=FrameKind.BATCH, run="r", epoch=0, shard=0, k=0, producer="p", sources=("a", "b")
    )
    for data in ([np.arange(70, dtype=np.uint8), np.zeros((0, 3))], [np.zeros(0), np.zeros(0)]):
        pieces = encode_frame_pieces(header, data, checksum=checksum)
        assert len(bytes(pieces)) == pieces.nbytes
        assert bytes(pieces) == bytes(encode_frame(header, data, checksum=checksum))
        assert decode_frame(bytes(pieces)).data[1].shape == data[1].shape


def test_checksum_on_frames_without_arrays() -> None:
    frame = decode_frame(enc(("v", [1, 2]), checksum=True))
    assert frame.data == ([1, 2],)
    assert decode_frame(enc(kind=FrameKind.END, count=0, checksum=True)).count == 0


@pytest.mark.parametrize("crc", [0, 1, 0xFFFF, 0x10000, 0xDEADBEEF, 0xFFFFFFFF])
def test_a_header_with_a_crc_ends_with_it_in_its_five_byte_form(crc: int) -> None:
    # The header is packed whole with a placeholder crc and the crc written over it: the
    # same bytes as packing it field by field with the crc's fixed-width form last.
    header = {"run": "r", "ep": 1, "items": [{"v": [1, "s", None]}], "pid": "p\u00e9"}
    packer = msgpack.Packer(use_bin_type=True)
    expected = packer.pack_map_header(len(header) + 1) + b"".join(
        packer.pack(k) + packer.pack(v) for k, v in header.items()
    )
    expected += packer.pack("crc") + b"\xce" + crc.to_bytes(4, "big")
    assert pack_header(header, crc) == expected
    assert pack_header(header, None) == msgpack.packb(header, use_bin_type=True)


@pytest.mark.parametrize("crc", ["0", -1, 2**32, True, 1.0])
def test_bad_crc_value_is_rejected(crc: Any) -> None:
    valid = enc(("x", np.arange(3)), checksum=True)
    assert reason_of(mutate(valid, lambda h: h.update(crc=crc))) == "bad_header"


# --------------------------------------------------------------------------- rejection

RAGGED = _ragged([2, 0, 3], "<i2")
VALID = enc(("x", np.arange(6, dtype="<f4").reshape(2, 3)), ("rag", RAGGED), ("v", "meta"))


# The last aligned offset in VALID's region: 24 bytes from there run past its end.
_LAST_ALIGNED = len(split(VALID)[3]) // 64 * 64


def test_the_fixture_frame_is_valid() -> None:
    assert decode_frame(mutate(VALID, lambda h: None)).sources == ("x", "rag", "v")


@pytest.mark.parametrize(
    ("buf", "reason"),
    [
        (b"", "too_short"),
        (b"BQF", "too_short"),
        (b"BQF\x01\x01\x00\x00\x00\x00\x00\x00", "too_short"),
        (b"hello, this is not a frame at all", "bad_magic"),
        (b"\x00" * 64, "bad_magic"),
        (b"BQR\x01some:key", "bad_magic"),
        (VALID[:3] + b"\x02" + VALID[4:], "bad_version"),
        (VALID[:3] + b"\x00" + VALID[4:], "bad_version"),
        (VALID[:4] + b"\x00" + VALID[5:], "bad_kind"),
        (VALID[:4] + b"\x04" + VALID[5:], "bad_kind"),
        (VALID[:4] + b"\xff" + VALID[5:], "bad_kind"),
        (VALID[:5] + b"\x00\x01\x00" + VALID[8:], "bad_header"),
        (VALID[:8] + struct.pack("<I", len(VALID)) + VALID[12:], "too_short"),
        (VALID[:8] + struct.pack("<I", 2**32 - 1) + VALID[12:], "too_short"),
    ],
)
def test_prefix_errors(buf: bytes, reason: str) -> None:
    assert reason_of(buf) == reason


def test_truncated_at_every_cut_point() -> None:
    hlen = struct.unpack_from("<I", VALID, 8)[0]
    for cut in range(len(VALID)):
        reason = reason_of(VALID[:cut])
        assert reason == ("too_short" if cut < 12 + hlen else "bad_range"), cut


def test_truncated_value_only_frame() -> None:
    buf = enc(("v", {"a": [1, 2, 3]}))
    for cut in range(len(buf)):
        assert reason_of(buf[:cut]) == "too_short"


def test_too_large() -> None:
    assert reason_of(VALID, max_frame_bytes=len(VALID) - 1) == "too_large"
    assert reason_of(b"junk" * 10, max_frame_bytes=8) == "too_large"  # checked first
    assert decode_frame(VALID, max_frame_bytes=len(VALID)).nbytes == len(VALID)


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x81\xa3run",  # truncated map
        msgpack.packb({"run": "r"}) + b"\x00",  # extra data after the map
        msgpack.packb({1: 2}),  # non-str map key (strict_map_key)
        msgpack.packb({"run": msgpack.ExtType(5, b"xx")}),  # extension types
        msgpack.packb([1, 2, 3]),  # a list, not a map
        msgpack.packb("a string"),
        msgpack.packb(None),
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion entries
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion entries
        b"\xdb\xff\xff\xff\xff",  # str claiming 4 GiB
        b"\x91" * 5000 + b"\xc0",  # deep nesting
        b"",
    ],
)
def test_header_that_is_not_a_msgpack_map(header: bytes) -> None:
    assert reason_of(build(header, b"\x00" * 64)) == "bad_header"


@pytest.mark.parametrize("key", ["run", "ep", "sh", "k", "g", "pid", "last", "src", "items"])
def test_missing_header_field(key: str) -> None:
    assert reason_of(mutate(VALID, lambda h: h.pop(key))) == "bad_header"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("run", 5),
        ("run", b"bytes"),
        ("ep", "2"),
        ("ep", -1),
        ("ep", 2.0),
        ("sh", None),
        ("k", True),
        ("k", -1),
        ("g", -2),
        ("pid", ["p"]),
        ("last", 1),
        ("last", True),  # without "n"
        ("n", 5),  # without last
        ("src", "x"),
        ("src", ["x", "rag", 3]),
        ("src", ["x", "x", "v"]),
        ("src", ["x", "rag"]),  # fewer sources than items
        ("items", {"x": 1}),
        ("items", []),
        ("err", "text on a BATCH frame"),
        ("ename", "ValueError"),
        ("t", "noon"),
        ("t", True),
    ],
)
def test_ill_typed_header_field(key: str, value: Any) -> None:
    assert reason_of(mutate(VALID, lambda h: h.update({key: value}))) == "bad_header"


def test_kind_specific_header_rules() -> None:
    end = enc(kind=FrameKind.END, count=3)
    assert reason_of(mutate(end, lambda h: h.update(last=False) or h.pop("n"))) == "bad_header"
    assert reason_of(mutate(end, lambda h: h.update(src=["x"], items=[{"v": 1}]))) == "bad_header"
    err = enc(kind=FrameKind.ERROR, error="tb")
    assert reason_of(mutate(err, lambda h: h.pop("err"))) == "bad_header"
    assert reason_of(mutate(err, lambda h: h.update(ename=3))) == "bad_header"
    assert decode_frame(mutate(VALID, lambda h: h.update(future_key=[1]))).sources  # ignored


def _set_desc(index: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def fn(header: dict[str, Any]) -> None:
        list(descriptors(header))[index].update(changes)

    return fn


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"dtype": "x9"}, "bad_dtype"),
        ({"dtype": "|O"}, "bad_dtype"),
        ({"dtype": "|O8"}, "bad_dtype"),
        ({"dtype": "O"}, "bad_dtype"),
        ({"dtype": "|V8"}, "bad_dtype"),
        ({"dtype": "|V4"}, "bad_dtype"),
        ({"dtype": "<i4,<f4"}, "bad_dtype"),
        ({"dtype": "(2,)<f4"}, "bad_dtype"),
        ({"dtype": "<T"}, "bad_dtype"),
        ({"dtype": "|S0"}, "bad_dtype"),
        ({"dtype": "<i1"}, "bad_dtype"),  # not numpy's canonical spelling ("|i1")
        ({"dtype": "f4"}, "bad_dtype"),  # no byte order
        ({"dtype": "<M8[bogus]"}, "bad_dtype"),
        ({"dtype": 5}, "bad_dtype"),
        ({"dtype": b"<f4"}, "bad_dtype"),
        ({"dtype": "<f4" * 20}, "bad_dtype"),
        ({"shape": [2, 2]}, "bad_shape"),  # 4 * 4 != 24
        ({"shape": [-2, -3]}, "bad_shape"),
        ({"shape": [2, 3.0]}, "bad_shape"),
        ({"shape": [2, True, 3]}, "bad_shape"),
        ({"shape": "2,3"}, "bad_shape"),
        ({"shape": [1] * 33 + [6]}, "bad_shape"),
        ({"shape": [0, 2**62], "len": 0}, "bad_shape"),
        ({"len": 25}, "bad_shape"),
        ({"len": -24, "shape": [-2, 3]}, "bad_shape"),
        ({"len": "24"}, "bad_shape"),
        ({"off": 1}, "bad_range"),  # misaligned
        ({"off": 32}, "bad_range"),
        ({"off": 10**6}, "bad_range"),  # past the end
        ({"off": _LAST_ALIGNED}, "bad_range"),  # starts inside, runs past the end
        ({"off": -64}, "bad_range"),  # inside the header
        ({"off": -(10**9)}, "bad_range"),
        ({"off": "0"}, "bad_range"),
        ({"off": None}, "bad_range"),
        ({"sc": True}, "bad_header"),  # only for 0-d arrays
        ({"sc": 1}, "bad_header"),
        ({"extra": 1}, "bad_header"),
    ],
)
def test_bad_array_descriptor(changes: dict[str, Any], reason: str) -> None:
    assert reason_of(mutate(VALID, _set_desc(0, **changes))) == reason


def test_bad_descriptor_inside_an_object_array() -> None:
    assert reason_of(mutate(VALID, _set_desc(1, dtype="|O"))) == "bad_dtype"
    assert reason_of(mutate(VALID, _set_desc(1, off=3))) == "bad_range"

    def wrong_count(h: dict[str, Any]) -> None:
        h["items"][1]["obj"] = [4]

    assert reason_of(mutate(VALID, wrong_count)) == "bad_shape"

    def nested(h: dict[str, Any]) -> None:
        h["items"][1]["items"][0] = {"obj": [0], "items": []}

    assert reason_of(mutate(VALID, nested)) == "bad_header"


@pytest.mark.parametrize(
    "item",
    [
        5,
        "x",
        None,
        [],
        {},
        {"v": 1, "dtype": "<f4"},
        {"obj": [1]},
        {"obj": [1], "items": "x"},
        {"obj": [-1], "items": []},
        {"nd": True, "type": "<f4", "shape": [1], "data": b"\0\0\0\0"},
    ],
)
def test_bad_item_entry(item: Any) -> None:
    def fn(h: dict[str, Any]) -> None:
        h["items"][2] = item

    assert reason_of(mutate(VALID, fn)) in {"bad_header", "bad_shape"}


# --------------------------------------------------------------------------- never unpickle


class _Canary:
    """Unpickling this would create the file at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_pickle_payloads_are_never_unpickled(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    payload = pickle.dumps(_Canary(str(canary)), protocol=pickle.HIGHEST_PROTOCOL)
    npy = io.BytesIO()
    np.save(npy, np.array([_Canary(str(canary))], dtype=object), allow_pickle=True)
    as_object = {"dtype": "|O", "shape": [1], "off": 0, "len": len(payload)}
    as_object8 = {"dtype": "|O8", "shape": [1], "off": 0, "len": 8}
    header = {"run": "r", "ep": 0, "sh": 0, "k": 0, "g": 0, "pid": "p", "last": False}
    cases = {
        payload: "bad_magic",
        npy.getvalue(): "bad_magic",
        build(payload, b"\0" * 64): "bad_header",
        build({**header, "src": ["x"], "items": [as_object]}, payload): "bad_dtype",
        build({**header, "src": ["x"], "items": [as_object8]}, payload.ljust(64)): "bad_dtype",
    }
    for buf, reason in cases.items():
        assert reason_of(buf) == reason
    assert not canary.exists()
    # A value entry may hold the bytes; they come back as bytes, still not unpickled.
    (got,) = decode_frame(build({**header, "src": ["x"], "items": [{"v": payload}]})).data
    assert got == payload
    assert not canary.exists()


def test_msgpack_numpy_style_maps_are_rejected(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    payload = pickle.dumps(_Canary(str(canary)))
    mn = {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": payload}
    assert reason_of(msgpack.packb(mn, use_bin_type=True)) == "bad_magic"
    assert reason_of(build(mn, payload)) == "bad_header"

    def as_item(h: dict[str, Any]) -> None:
        h["items"][0] = mn

    assert reason_of(mutate(VALID, as_item)) == "bad_header"
    # As a plain value it stays an inert dict of bytes.
    (got,) = decode_frame(enc(("v", mn))).data
    assert got == mn
    assert not canary.exists()


# --------------------------------------------------------------------------- fuzzing


@FAST
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    decodes_or_frame_error(data)
    decodes_or_frame_error(MAGIC + b"\x01\x01\x00\x00\x00" + data)
    decodes_or_frame_error(build(data, data))


@FAST
@given(st.data())
def test_mutated_valid_frames_never_escape(data: st.DataObject) -> None:
    buf = bytearray(VALID)
    hlen = struct.unpack_from("<I", VALID, 8)[0]
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 12 + hlen - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    decodes_or_frame_error(bytes(buf))


ANY_MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=6) | st.binary(max_size=6),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=10,
)  # fmt: skip
DESC_VALUES = st.one_of(
    ANY_MSGPACK,
    st.sampled_from(["<f4", "|u1", "|O", "|V4", "<U2", "x9"]),
    st.lists(st.integers(-3, 70), max_size=3),
    st.integers(-128, 4096),
)


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["dtype", "shape", "off", "len", "sc", "v", "obj", "items"]),
        DESC_VALUES,
    ),
    st.dictionaries(
        st.sampled_from(["run", "ep", "sh", "k", "g", "pid", "last", "n", "src", "err", "t"]),
        ANY_MSGPACK,
    ),
)
def test_random_headers_never_escape(entry: dict[str, Any], fields: dict[str, Any]) -> None:
    def replace_item(h: dict[str, Any]) -> None:
        h["items"][0] = entry

    decodes_or_frame_error(mutate(VALID, replace_item))
    decodes_or_frame_error(mutate(VALID, lambda h: h.update(fields)))
    decodes_or_frame_error(build(fields, b"\x00" * 256))


# --------------------------------------------------------------------------- encode errors


class _Opaque:
    pass


# numpy >= 2 has a variable-width string dtype (kind "T"), whose bytes are pointers.
_STRING_DTYPE = getattr(getattr(np, "dtypes", None), "StringDType", None)
_STRING_DTYPE_CASE = [(np.array(["a"], dtype=_STRING_DTYPE()), "T")] if _STRING_DTYPE else []


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({1, 2}, "set"),
        (_Opaque(), "_Opaque"),
        ([1, [2, {3}]], "set"),
        ({"k": _Opaque()}, "_Opaque"),
        ({1: "int key"}, "int"),
        (2**64, "64 bits"),
        ("\ud800", "surrogates"),
        (np.ma.masked_array([1, 2], mask=[False, True]), "masked"),
        (np.zeros(2, dtype="i4,f4"), "V"),
        (np.zeros(2, dtype="V8"), "V"),
        (np.void(b"ab"), "V"),
        *_STRING_DTYPE_CASE,
    ],
)
def test_unencodable_values_raise_config_error(value: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        enc(("src_name", value))
    assert "src_name" in str(info.value)


@pytest.mark.parametrize(
    ("element", "named"),
    [
        ({1, 2}, "set"),
        (_Opaque(), "_Opaque"),
        (np.zeros(1, dtype="V2"), "V2"),
        (np.empty(1, dtype=object), "nested object arrays"),
    ],
)
def test_unencodable_object_array_elements(element: Any, named: str) -> None:
    obj = np.empty(2, dtype=object)
    obj[0] = np.arange(2)
    obj[1] = element
    with pytest.raises(ConfigError, match=f"'feats' element 1.*{named}"):
        enc(("feats", obj))


def test_deep_values_are_refused() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ConfigError, match="nests deeper"):
        enc(("v", deep))


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": 7},
        {"kind": "BATCH"},
        {"run": 3},
        {"producer": None},
        {"epoch": -1},
        {"shard": 1.0},
        {"k": True},
        {"g": -2},
        {"last": 1, "count": 1},
        {"last": True},  # count missing
        {"count": 3},  # count without last
        {"last": True, "count": -1},
        {"error": "tb"},  # on a BATCH frame
        {"error_name": "X"},
        {"kind": FrameKind.ERROR},  # without error
        {"kind": FrameKind.ERROR, "error": "tb", "error_name": 5},
        {"produced_at": "now"},
        {"sources": ("a", "b"), "data": (1,)},
        {"sources": ("a",), "data": (1, 2)},
        {"sources": ("a", "a"), "data": (1, 2)},
        {"sources": (1,), "data": (1,)},
        {"sources": ("a",), "data": (1,), "kind": FrameKind.END},
        {"run": "\udcff"},
    ],
)
def test_bad_encode_arguments(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"run": "r", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}
    args.update(kw)
    kind = args.pop("kind", FrameKind.BATCH)
    with pytest.raises(ConfigError):
        encode_with(encode_frame, kind, **args)


def test_max_frame_bytes_on_encode() -> None:
    arr = np.zeros(1000, np.uint8)
    size = len(enc(("x", arr)))
    assert len(enc(("x", arr), max_frame_bytes=size)) == size
    with pytest.raises(ConfigError, match=rf"{size} bytes exceeds max_frame_bytes={size - 1}"):
        enc(("x", arr), max_frame_bytes=size - 1)


def test_numpy_integers_are_accepted_as_coordinates() -> None:
    frame = decode_frame(enc(epoch=np.int64(1), shard=np.uint8(2), k=np.int32(3), g=np.int64(4)))
    assert (frame.epoch, frame.shard, frame.k, frame.g) == (1, 2, 3, 4)
    assert type(frame.epoch) is int


def test_end_frames_are_always_last() -> None:
    assert decode_frame(enc(kind=FrameKind.END, count=2)).last is True


def test_frame_is_frozen_and_as_dict() -> None:
    frame = decode_frame(VALID)
    with pytest.raises(AttributeError):
        frame.k = 5  # type: ignore[misc]
    d = frame.as_dict()
    assert list(d) == ["x", "rag", "v"] and d["v"] == "meta"
    assert math.isclose(float(d["x"][1, 2]), 5.0)


@pytest.mark.parametrize("checksum", [False, True])
def test_pieces_are_the_same_bytes_as_the_frame(checksum: bool) -> None:
    data = [
        np.arange(24, dtype="<f4").reshape(2, 3, 4).transpose(2, 0, 1),  # not contiguous
        np.array(["2026-12-02", "2027-01-01"], dtype="datetime64[D]"),
        np.zeros(0, dtype="u1"),
        np.array(7, dtype=">i8"),
        ["ragged", [1, 2]],
        np.array([np.arange(3), np.arange(5)], dtype=object),
    ]
    kw: dict[str, Any] = {"run": "r", "epoch": 1, "shard": 2, "k": 3, "producer": "p"}
    kw.update(sources=[f"s{i}" for i in range(len(data))], data=data, checksum=checksum)
    whole = bytes(encode_with(encode_frame, FrameKind.BATCH, **kw))
    pieces = encode_with(encode_frame_pieces, FrameKind.BATCH, **kw)
    assert len(pieces) == len(whole) and bytes(pieces) == whole
    assert all(not isinstance(b, memoryview) or b.format == "B" for b in pieces.buffers)


# --------------------------------------------------------------------------- lists


@pytest.mark.parametrize(
    ("value", "dtype", "shape"),
    [
        ([[0] * 128] * 100, "<i8", (100, 128)),  # Fuel's server tutorial batch
        ((1, 2, 3), "<i8", (3,)),
        ([2**63, 2**64 - 1], "<u8", (2,)),  # above int64: numpy's uint64, exact
        ([[0.5, 1.0], [2.0, 3.0]], "<f8", (2, 2)),
        ([True, False], "|b1", (2,)),
        ([1j, 2.0 + 0j], "<c16", (2,)),
        (["a", "bc"], "<U2", (2,)),
        ([np.int32(1), 2], "<i8", (2,)),  # numpy scalars count as their kind
        ([np.float32(1.5), np.float32(2)], "<f4", (2,)),
        ([np.arange(3), np.arange(3)], "<i8", (2, 3)),  # equal arrays: stacked, as Fuel
    ],
)
def test_a_list_numpy_makes_a_regular_array_of_its_kind_becomes_that_array(
    value: Any, dtype: str, shape: tuple[int, ...]
) -> None:
    arr = array_or_value(value)
    assert isinstance(arr, np.ndarray)
    assert arr.dtype.str == dtype and arr.shape == shape
    assert arr.tolist() == np.asarray(value).tolist()
    frame = decode_frame(enc(("x", arr)))  # and it travels as an array
    assert frame.data[0].dtype.str == dtype and frame.data[0].shape == shape


@pytest.mark.parametrize(
    "value",
    [
        3,
        2.5,
        "abc",
        b"abc",
        None,
        {"a": [1, 2]},
        np.arange(3),  # already an array: the very object
        [],
        [[], []],  # empty: numpy's float64 would be a guess
        [[1, 2], [3]],  # ragged
        [[1, 2], 3],
        [1, 2.5],  # mixed: ints made floats
        [True, 2],  # bools made ints
        [1, "a"],  # ints made str
        [None, 1],
        [{"a": 1}],
        [b"a", b"b"],  # numpy's bytes drop trailing NULs: msgpack keeps them
        ["a\0", "b"],  # ... so do its str
        [2**63, -1],  # numpy: float64
        [2**64],  # numpy: object
        [np.longdouble(1)],  # not portable: refused by the codec as before
        [np.ma.masked_array([1, 2])],  # np.asarray would drop the mask
        [np.arange(2), np.arange(3)],
        [np.array([1], dtype=object)],
        [np.datetime64("2026-12-02")],
    ],
)
def test_any_other_value_is_left_as_it_is(value: Any) -> None:
    assert array_or_value(value) is value
