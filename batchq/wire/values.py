"""The parts of a frame every item shares: the bounds on values, the item specs, the
fixed prefix, header packing and the buffer region's layout.

An *item* is one source's value inside a frame. The header describes each item with one
msgpack map (see :mod:`batchq.wire.codec` for the key names); the raw array bytes live in
the frame's buffer region. A value becomes its map in :mod:`batchq.wire.items`
(recording which arrays must be copied where; a batch of lists first the array numpy
makes of it), and a validated map a value again there.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, NamedTuple

import msgpack
import numpy as np

from batchq.errors import ConfigError, FrameError

#: dtype kinds whose bytes are plain data (no pointers, no Python objects).
ALLOWED_KINDS = frozenset("biufcSUMm")

#: numpy (1.x) refuses more dimensions than this; 2.x allows 64, we keep the common bound.
MAX_NDIM = 32

#: How deep a Python value may nest; msgpack itself stops at a few hundred levels.
MAX_VALUE_DEPTH = 64


#: The float and complex sizes a frame may hold (bytes per item).
PORTABLE_SIZES = {"f": (2, 4, 8), "c": (8, 16)}

#: Frame-relative alignment of the buffer region and of every array in it.
ALIGN = 64

#: The fixed prefix: magic, version, kind, reserved, header length (little-endian).
PREFIX = struct.Struct("<3sBB3sI")


# A pending copy: the source array and the descriptor whose "off" the layout fills in.
Copy = tuple[np.ndarray, dict[str, Any]]


class ArraySpec(NamedTuple):
    """A validated array descriptor."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    off: int
    length: int
    scalar: bool


class ValueSpec(NamedTuple):
    """A validated msgpack value entry."""

    value: Any


class ObjectSpec(NamedTuple):
    """A validated object-array entry: its shape and its elements in C order."""

    shape: tuple[int, ...]
    elems: tuple[ArraySpec | ValueSpec, ...]


Spec = ArraySpec | ValueSpec | ObjectSpec


# --------------------------------------------------------------------------- header


# The placeholder a header's crc is packed with before it is known (its 5-byte form).
_CRC_PLACEHOLDER = 0xFFFFFFFF


def align(n: int) -> int:
    """Round ``n`` up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def pack_header(header: dict[str, Any], crc: int | None) -> bytes:
    """Pack a header map, with a trailing fixed-width ``crc`` entry when ``crc`` is set.

    Raises:
        ConfigError: a field cannot be packed (a str with lone surrogates).
    """
    # Every frame packs its header twice or more (layout): the whole map at once is half
    # the CPU of field by field, and the same bytes. A crc goes last as a uint32, which
    # msgpack packs in its 5-byte form for 0xFFFFFFFF: packed so, then overwritten.
    if crc is None or "crc" not in header:
        whole = header if crc is None else {**header, "crc": _CRC_PLACEHOLDER}
        with contextlib.suppress(TypeError, ValueError, OverflowError):  # named below
            packed: bytes = msgpack.packb(whole, use_bin_type=True)
            return packed if crc is None else packed[:-4] + crc.to_bytes(4, "big")
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(header) + (crc is not None))]
    try:
        for key, value in header.items():
            parts += (packer.pack(key), packer.pack(value))
    except (TypeError, ValueError, OverflowError) as e:  # values were checked: str surrogates
        raise ConfigError(f"cannot encode the header field {key!r}: {e}") from e
    if crc is not None:
        # Always the 5-byte uint32 form, so that filling in the real crc after the copy
        # changes neither the header's length nor the layout.
        parts += (packer.pack("crc"), b"\xce" + crc.to_bytes(4, "big"))
    return b"".join(parts)


def layout(header: dict[str, Any], copies: list[Copy], checksum: bool) -> tuple[bytes, int, int]:
    """Place the arrays of ``copies`` (setting their ``off``) and pack the header.

    Args:
        header: the header, its ``items`` holding the descriptors of ``copies``.
        copies: the arrays to place, in order.
        checksum: reserve room for a ``crc`` entry.

    Returns:
        ``(packed header, start of the buffer region, total frame length)``; with
        ``checksum`` the packed header holds a placeholder crc of the final length.
    """
    # Offsets are absolute, so the header's length depends on them and vice versa. Larger
    # offsets never pack shorter, so growing data_start until it holds the header converges
    # (in practice in one or two rounds).
    crc = _CRC_PLACEHOLDER if checksum else None
    data_start = align(PREFIX.size + 1)
    while True:
        cursor = end = data_start
        for _, desc in copies:
            desc["off"] = cursor
            end = cursor + desc["len"]
            cursor = align(end)
        packed = pack_header(header, crc)
        need = align(PREFIX.size + len(packed))
        if need <= data_start:
            break
        data_start = need
    total = end if copies else PREFIX.size + len(packed)
    return packed, data_start, total


def short(value: Any, limit: int = 80) -> str:
    """Return ``repr(value)``, cut to ``limit`` characters: frames may hold huge values."""
    if isinstance(value, list | dict) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value)} entries"  # skip a huge repr
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack_header(raw: memoryview) -> dict[Any, Any]:
    """Unpack a frame header with limits no larger than the header itself.

    Raises:
        FrameError: ``bad_header`` when ``raw`` is not one msgpack map.
    """
    limit = len(raw)
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
            max_bin_len=limit, max_str_len=limit, max_array_len=limit, max_map_len=limit,
            max_ext_len=limit,
        )  # fmt: skip
    except Exception as e:  # msgpack raises a zoo (ValueError, FormatError, StackError, ...)
        raise FrameError("bad_header", f"header is not valid msgpack: {e!r}") from None
    if not isinstance(header, dict):
        raise FrameError("bad_header", f"header is a {type(header).__name__}, expected a map")
    return header
