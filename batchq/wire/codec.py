"""The wire codec: one Redis list element is one *frame*.

Layout (offsets from the start of the frame)::

    0   b"BQF"              magic
    3   u8                  format version (1)
    4   u8                  kind: 1 BATCH, 2 END, 3 ERROR
    5   3 bytes             reserved, zero
    8   u32 little-endian   H, the header's length
    12  H bytes             msgpack header (a map)
        zero padding        up to the next multiple of 64: the *buffer region* starts here
        array buffers       each at a 64-aligned offset, C order, in the dtype's byte order

A frame without array bytes ends right after its header (no padding).

Header keys (short, to keep small frames small):

=========  ===============================================================================
``run``    run id (str)
``ep``     epoch (int >= 0)
``sh``     shard index inside the epoch (int >= 0)
``k``      position of the batch in its shard (int >= 0)
``g``      global batch index in plan order (int >= -1; -1: unknown)
``pid``    producer id (str)
``last``   bool: this is the shard's last frame (END frames are last, with no data)
``n``      number of batches in the shard; present exactly when ``last``
``src``    source names (list of str)
``items``  one entry per source, in ``src`` order (see below)
``err``    traceback text (ERROR frames only)
``ename``  exception class name (ERROR frames only, optional)
``crc``    optional crc32 (zlib's) of the whole frame (prefix, header and buffer region), its
           own 4 value bytes read as zeros; always the header's last entry, written as
           a fixed-width uint32 (``0xce`` + 4 bytes big-endian)
``t``      optional producer wall time (float, seconds since the epoch) at encoding
``pv``     optional params version (int >= 0; absent: 0): the version of the run's params
           log in effect at the batch's global index when it was built
           (:mod:`batchq.protocol.params_log`); a trainer never yields a frame whose
           version is not the one in effect for its index
=========  ===============================================================================

An item entry is one of:

* an array: ``{"dtype": dtype.str, "shape": [int, ...], "off": int, "len": int}`` plus
  ``"sc": true`` when the value was a numpy scalar (it decodes to a numpy scalar);
* a Python value: ``{"v": value}`` (None, bool, int, float, str, bytes, lists, dicts);
* an object array (ragged data): ``{"obj": shape, "items": [...]}``, its elements in C
  order, each an array entry or a value entry. Object bytes never travel.

Unknown header keys are ignored (room for optional additions within version 1); item
entries must have exactly the keys above. Limits: 32 dimensions, values nested at most
64 deep, reference keys of at most 1024 bytes.

Allowed dtype kinds: ``b i u f c S U M m``, either byte order. Decoding validates the
whole header before touching numpy, never copies array bytes (arrays are read-only
``np.frombuffer`` views unless ``writable=True``), never unpickles, and turns every
malformation into :class:`~batchq.errors.FrameError`.

A producer passes each source's value through :func:`array_or_value` first: a list
that numpy turns into a regular array of one plain kind travels as that array, as
Fuel's server sent it; the codec itself encodes a list as the msgpack value it is.

Large frames may live under their own Redis key; the list then holds a *reference*
element instead (:func:`batchq.wire.frame.encode_ref`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:  # ISA-L's crc32: zlib's values, ~25x faster over an image's bytes (~5 us for 256 KiB)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal's wheel
    from zlib import crc32

from batchq.errors import ConfigError, FrameError
from batchq.wire.frame import (
    FORMAT_VERSION,
    KINDS,
    MAGIC,
    Frame,
    FrameHeader,
    FrameKind,
    Pieces,
    header_fields,
    header_problem,
    is_int,
)
from batchq.wire.items import array_or_value, build_item, encode_item, parse_item
from batchq.wire.values import (
    PREFIX,
    Copy,
    Spec,
    align,
    layout,
    short,
    unpack_header,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Frame",
    "FrameHeader",
    "FrameKind",
    "array_or_value",
    "decode_frame",
    "encode_frame",
    "encode_frame_into",
    "encode_frame_pieces",
    "is_frame",
    "peek_header",
]

_RESERVED = b"\x00\x00\x00"


# How a crc entry ends a header: the key "crc" (fixstr), then a uint32 marker.
_CRC_TAIL = b"\xa3crc\xce"
_CRC_ZERO = bytes(4)


# --------------------------------------------------------------------------- encoding


def encode_frame(
    header: FrameHeader,
    data: Sequence[Any] = (),
    *,
    checksum: bool = False,
    max_frame_bytes: int | None = None,
) -> memoryview:
    """Encode one frame into a single freshly allocated buffer.

    The frame's size is computed first; each array's bytes are then copied once, straight
    into their place (non-contiguous arrays are gathered by that same copy).

    Args:
        header: what the frame says about itself (:class:`FrameHeader`).
        data: one value per source: an ``np.ndarray`` of an allowed dtype, a numpy scalar,
            an object array of such arrays or values (ragged data), or a plain Python value.
        checksum: store a crc32 of the buffer region.
        max_frame_bytes: refuse (before allocating) frames larger than this.

    Returns:
        The encoded frame.

    Raises:
        ConfigError: an argument is invalid, a value cannot be encoded, or the frame
            would exceed ``max_frame_bytes``.
    """
    kind, _fields, packed, data_start, total, copies = _prepare(
        header, data, checksum, max_frame_bytes
    )
    # Not bytearray(total): zero-filling MBs that the copies overwrite cost two thirds of
    # the copy itself (measured at 4.8 MB). Only the gaps (padding) are zeroed.
    buf = np.empty(total, dtype=np.uint8)
    _fill(buf, kind, packed, data_start, copies, checksum)
    return memoryview(buf)  # type: ignore[arg-type]


def encode_frame_into(
    alloc: Callable[[int], Any],
    header: FrameHeader,
    data: Sequence[Any] = (),
    *,
    checksum: bool = False,
    max_frame_bytes: int | None = None,
) -> tuple[int, Any] | None:
    """Encode one frame straight into a buffer that ``alloc`` hands out (a shared-memory
    segment): the same bytes as :func:`encode_frame`, each array copied once, into place.

    Args:
        alloc: called with the frame's size once it is known; returns a writable buffer
            of at least that size, or None (then nothing is written).
        header, data, checksum, max_frame_bytes: as :func:`encode_frame`.

    Returns:
        (the frame's length, the buffer ``alloc`` returned), or None when it returned None.

    Raises:
        ConfigError: as :func:`encode_frame`, or the buffer is smaller than the frame.
    """
    kind, _fields, packed, data_start, total, copies = _prepare(
        header, data, checksum, max_frame_bytes
    )
    target = alloc(total)
    if target is None:
        return None
    buf = np.frombuffer(target, dtype=np.uint8)
    if buf.size < total:
        raise ConfigError(f"frame of {total} bytes does not fit in {buf.size} bytes")
    _fill(buf[:total], kind, packed, data_start, copies, checksum)
    return total, target


def _fill(
    buf: Any,
    kind: FrameKind,
    packed: bytes,
    data_start: int,
    copies: list[Copy],
    checksum: bool,
) -> None:
    """Write a prepared frame into ``buf`` (a uint8 array of exactly its size)."""
    out = memoryview(buf)
    PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, int(kind), _RESERVED, len(packed))
    end = PREFIX.size + len(packed)
    for arr, desc in copies:
        if desc["len"]:
            buf[end : desc["off"]] = 0
            dst = np.ndarray(arr.shape, dtype=arr.dtype, buffer=buf, offset=desc["off"])
            np.copyto(dst, arr, casting="no")
            end = desc["off"] + desc["len"]
    buf[end:] = 0
    header_end = PREFIX.size + len(packed)
    out[PREFIX.size : header_end] = packed
    if checksum:
        # The crc covers the header too (a flipped address is as bad as a flipped pixel):
        # computed with its own bytes zero, then filled in: its last 4 bytes.
        out[header_end - 4 : header_end] = _CRC_ZERO
        out[header_end - 4 : header_end] = crc32(out).to_bytes(4, "big")


def encode_frame_pieces(
    header: FrameHeader,
    data: Sequence[Any] = (),
    *,
    checksum: bool = False,
    max_frame_bytes: int | None = None,
) -> Pieces:
    """Encode one frame as buffers that are sent back to back, without copying arrays.

    The same bytes as :func:`encode_frame` (arguments and errors alike), as the
    prefix and header, then each array's own memory and the padding between: the
    producer's hot path sends them straight to the socket (see
    :class:`batchq.wire.frame.Pieces`), so a contiguous batch is never copied in Python.
    """
    kind, _fields, packed, data_start, total, copies = _prepare(
        header, data, checksum, max_frame_bytes
    )
    pieces: list[bytes | memoryview] = []
    cursor = data_start
    for arr, desc in copies:
        if not desc["len"]:
            continue
        if desc["off"] > cursor:
            pieces.append(bytes(desc["off"] - cursor))
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        pieces.append(memoryview(flat))  # type: ignore[arg-type]
        cursor = desc["off"] + desc["len"]
    head = bytearray(data_start if copies else PREFIX.size + len(packed))
    held = len(head) + sum(len(piece) for piece in pieces)
    if total > held:  # trailing empty arrays: their offsets pad the frame past the bytes held
        pieces.append(bytes(total - held))
    PREFIX.pack_into(head, 0, MAGIC, FORMAT_VERSION, int(kind), _RESERVED, len(packed))
    header_end = PREFIX.size + len(packed)
    head[PREFIX.size : header_end] = packed
    if checksum:
        # As _fill: the crc over the frame with its own 4 bytes zero, then put in place.
        head[header_end - 4 : header_end] = _CRC_ZERO
        crc = crc32(head)
        for piece in pieces:
            crc = crc32(piece, crc)
        head[header_end - 4 : header_end] = crc.to_bytes(4, "big")
    return Pieces([bytes(head), *pieces], total)


def _prepare(
    spec: FrameHeader, data: Sequence[Any], checksum: bool, max_frame_bytes: int | None
) -> tuple[FrameKind, dict[str, Any], bytes, int, int, list[Copy]]:
    """Validate, build the header and place the arrays: what the encoders share."""
    if not isinstance(spec, FrameHeader):
        raise ConfigError(f"header {spec!r} is not valid: expected a FrameHeader")
    kind = _check_kind(spec.kind)
    sources, data = tuple(spec.sources), tuple(data)
    if len(sources) != len(data):
        raise ConfigError(f"{len(sources)} sources but {len(data)} data values")
    header = header_fields(spec, kind)
    copies: list[Copy] = []
    header["items"] = [encode_item(s, v, copies) for s, v in zip(sources, data, strict=True)]

    packed, data_start, total = layout(header, copies, checksum)
    if max_frame_bytes is not None and total > max_frame_bytes:
        raise ConfigError(
            f"frame of {total} bytes exceeds max_frame_bytes={max_frame_bytes} "
            f"(run {spec.run!r}, epoch {spec.epoch}, shard {spec.shard}, k {spec.k})"
        )
    return kind, header, packed, data_start, total, copies


def _check_kind(kind: Any) -> FrameKind:
    try:
        return FrameKind(kind)
    except (TypeError, ValueError):
        raise ConfigError(f"kind {kind!r}: expected a FrameKind (1, 2 or 3)") from None


# --------------------------------------------------------------------------- decoding


def decode_frame(
    buf: bytes | bytearray | memoryview,
    *,
    writable: bool = False,
    max_frame_bytes: int | None = None,
    verify_checksum: bool = True,
    require_checksum: bool = False,
) -> Frame:
    """Decode and validate one frame.

    Args:
        buf: the list element. Arrays are views over it, so it stays alive with them.
        writable: return writable copies instead of read-only views.
        max_frame_bytes: reject larger frames (``too_large``) before parsing anything.
        verify_checksum: check the crc when the frame has one.
        require_checksum: reject a frame without a crc (``no_checksum``): where every
            frame is written with one (a cache entry), a header whose crc key was
            damaged must not switch the check off.

    Returns:
        The frame.

    Raises:
        FrameError: the element is not a valid frame; ``reason`` says why.
        ConfigError: ``buf`` is not bytes-like (a str: was the Redis client created
            with ``decode_responses=True``?).
    """
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise ConfigError(
            f"decode_frame needs bytes, got {type(buf).__name__} "
            "(is the Redis client created with decode_responses=True?)"
        ) from e
    size = len(view)
    if max_frame_bytes is not None and size > max_frame_bytes:
        raise FrameError("too_large", f"frame of {size} bytes exceeds max {max_frame_bytes}")
    frame_kind, hlen, header = _read_header(view, size)
    specs = _item_specs(header, align(PREFIX.size + hlen), size)
    crc = header.get("crc")
    if crc is not None:
        _check_crc(view, PREFIX.size + hlen, crc, verify_checksum)
    elif require_checksum:
        raise FrameError("no_checksum", "a frame without its crc where one is required")
    source = buf if isinstance(buf, bytes | bytearray) else view
    t = header.get("t")
    return Frame(
        kind=frame_kind, run=header["run"], epoch=header["ep"], shard=header["sh"],
        k=header["k"], g=header["g"], producer=header["pid"], last=header["last"],
        count=header.get("n"), sources=tuple(header["src"]),
        data=tuple(build_item(spec, source, writable) for spec in specs),
        error=header.get("err"), error_name=header.get("ename"), nbytes=size,
        produced_at=None if t is None else float(t), params_version=header.get("pv", 0),
    )  # fmt: skip


def _item_specs(header: dict[Any, Any], data_start: int, size: int) -> list[Spec]:
    """The header's items checked, one per source, before numpy sees any of them."""
    sources, items = header["src"], header.get("items")
    if not isinstance(items, list) or len(items) != len(sources):
        raise FrameError(
            "bad_header", f"'items' is {short(items)}, expected a list of {len(sources)}"
        )
    return [
        parse_item(entry, f"source {short(src)}", data_start, size)
        for src, entry in zip(sources, items, strict=True)
    ]


def _check_crc(view: memoryview, header_end: int, crc: Any, verify: bool) -> None:
    """The header's crc entry is well-formed (a uint32, its last fixed-width entry) and,
    if ``verify``, matches the frame (computed with the crc's own bytes zero)."""
    if not is_int(crc, 0) or crc > 0xFFFFFFFF:
        raise FrameError("bad_header", f"'crc' is {short(crc)}, expected a uint32")
    end = header_end
    if bytes(view[end - 9 : end]) != _CRC_TAIL + crc.to_bytes(4, "big"):
        raise FrameError("bad_header", "'crc' is not the header's last, fixed-width entry")
    if verify:
        found = crc32(view[end:], crc32(_CRC_ZERO, crc32(view[: end - 4])))
        if found != crc:
            raise FrameError("bad_checksum", f"frame crc32 {found:#010x} differs from {crc:#010x}")


def peek_header(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Validate a frame's prefix and header and return the header, without its data.

    For monitoring: ``buf`` may be only the first bytes of a frame (``GETRANGE key 0
    65535`` of a frame stored by reference); nothing past the header is read. The
    header's fields are checked as :func:`decode_frame` checks them; its ``items`` are
    not (they describe data that may not be in ``buf``).

    Args:
        buf: a frame, or a prefix of one that holds at least its whole header.

    Returns:
        The msgpack header (``t`` is the producer's wall time at encoding, if sent).

    Raises:
        FrameError: the prefix or the header is not valid (``too_short`` when ``buf``
            ends before the header does).
        ConfigError: ``buf`` is not bytes-like.
    """
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise ConfigError(f"peek_header needs bytes, got {type(buf).__name__}") from e
    return _read_header(view, len(view))[2]


def _read_header(view: memoryview, size: int) -> tuple[FrameKind, int, dict[Any, Any]]:
    """Validate the prefix and the msgpack header: (kind, header length, header)."""
    if size < PREFIX.size:
        raise FrameError("too_short", f"{size} bytes, a frame has at least {PREFIX.size}")
    magic, version, kind, reserved, hlen = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"starts with {bytes(view[:4])!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FrameError("bad_version", f"format version {version}, expected {FORMAT_VERSION}")
    if kind not in KINDS:
        raise FrameError("bad_kind", f"kind {kind}, expected 1 (BATCH), 2 (END) or 3 (ERROR)")
    if reserved != _RESERVED:
        raise FrameError("bad_header", f"reserved bytes {reserved!r}, expected zeros")
    if PREFIX.size + hlen > size:
        raise FrameError("too_short", f"header of {hlen} bytes ends past the {size} bytes given")
    header = unpack_header(view[PREFIX.size : PREFIX.size + hlen])
    frame_kind = FrameKind(kind)
    problem = header_problem(frame_kind, header)
    if problem:
        raise FrameError("bad_header", problem)
    return frame_kind, hlen, header


def is_frame(elem: Any) -> bool:
    """Whether ``elem`` looks like a frame (a cheap prefix check; decode to validate)."""
    return isinstance(elem, bytes | bytearray | memoryview) and bytes(elem[:3]) == MAGIC
