"""Helpers of :mod:`batchq.wire.codec`: header packing and layout, item encoding and decoding.

An *item* is one source's value inside a frame. The header describes each item with one
msgpack map (see :mod:`batchq.wire.codec` for the key names); the raw array bytes live in the
frame's buffer region. This module turns values into those maps (recording which arrays
must be copied where) and turns validated maps back into values.

Decoding is split in two passes so that nothing reaches numpy before the whole header
has been checked: :func:`parse_item` validates a header entry into a spec (only
``np.dtype`` on an allow-listed string is called), and :func:`build_item` turns a spec
into arrays with ``np.frombuffer``. Object bytes are never stored or read: an object
array travels as a list of its elements, each an array or a msgpack value.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import re
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

# numpy refuses shapes whose (non-zero) extent overflows; keep well below that so that a
# zero-size array with an absurd other dimension is a FrameError, not a numpy ValueError.
_MAX_EXTENT = 2**60

# The only dtype spellings ``dtype.str`` produces for the allowed kinds. Matching this
# first keeps arbitrary header strings away from numpy's dtype parser.
# Floats and complexes only in their IEEE sizes: float128/complex256 (f16, c32) and
# longdouble are platform-dependent (80-bit extended on x86, quad on others), and a
# frame must mean the same on every host.
_DTYPE_RE = re.compile(
    r"[<>|](?:b1|[iu][1248]|f[248]|c(?:8|16)|[SU][0-9]{1,9}|[Mm]8(?:\[[0-9]{0,9}[a-zA-Z]{1,3}\])?)"
)

#: The float and complex sizes a frame may hold (bytes per item).
PORTABLE_SIZES = {"f": (2, 4, 8), "c": (8, 16)}

#: Frame-relative alignment of the buffer region and of every array in it.
ALIGN = 64

#: The fixed prefix: magic, version, kind, reserved, header length (little-endian).
PREFIX = struct.Struct("<3sBB3sI")

_ARRAY_KEYS = frozenset({"dtype", "shape", "off", "len"})
_SCALAR_KEYS = _ARRAY_KEYS | {"sc"}

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


def align(n: int) -> int:
    """Round ``n`` up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def pack_header(header: dict[str, Any], crc: int | None) -> bytes:
    """Pack a header map, with a trailing fixed-width ``crc`` entry when ``crc`` is set.

    Raises:
        ConfigError: a field cannot be packed (a str with lone surrogates).
    """
    if crc is None:
        # Every frame packs its header twice or more (layout): the whole map at once is
        # half the CPU of field by field, and the same bytes.
        with contextlib.suppress(TypeError, ValueError, OverflowError):  # named below
            packed: bytes = msgpack.packb(header, use_bin_type=True)
            return packed
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
    crc = 0xFFFFFFFF if checksum else None
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


# --------------------------------------------------------------------------- encoding


def encode_item(source: str, value: Any, copies: list[Copy]) -> dict[str, Any]:
    """Describe one source's value for the header, queueing its array bytes in ``copies``.

    Args:
        source: the source's name, used in error messages.
        value: an ``np.ndarray`` (object dtype included), a numpy scalar, or a msgpack-able
            Python value.
        copies: receives ``(array, descriptor)`` for every array whose bytes the frame
            must carry; the caller sets each descriptor's ``off``.

    Returns:
        The item's header entry.

    Raises:
        ConfigError: the value (or an element of an object array) cannot be encoded.
    """
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":
        if value.ndim > MAX_NDIM:
            raise ConfigError(f"source {source!r}: {value.ndim} dimensions, at most {MAX_NDIM}")
        where = f"source {source!r} element"
        elems = [_encode_elem(f"{where} {i}", e, copies) for i, e in enumerate(value.flat)]
        return {"obj": list(value.shape), "items": elems}
    return _encode_elem(f"source {source!r}", value, copies)


def _encode_elem(where: str, value: Any, copies: list[Copy]) -> dict[str, Any]:
    if isinstance(value, np.ndarray | np.generic):
        return _encode_array(where, value, copies)
    check_value(value, where)
    return {"v": value}


def _encode_array(where: str, value: np.ndarray | np.generic, copies: list[Copy]) -> dict[str, Any]:
    if isinstance(value, np.ma.MaskedArray):
        # np.asarray would silently drop the mask.
        raise ConfigError(f"{where}: masked arrays cannot be encoded; fill them first")
    arr = np.asarray(value)
    dt = arr.dtype
    if dt.kind == "O":
        raise ConfigError(f"{where}: nested object arrays cannot be encoded")
    if dt.kind not in ALLOWED_KINDS or dt.itemsize == 0:
        raise ConfigError(
            f"{where}: dtype {dt.str!r} (kind {dt.kind!r}) cannot be encoded; "
            f"allowed kinds are {''.join(sorted(ALLOWED_KINDS))}"
        )
    if dt.kind in PORTABLE_SIZES and dt.itemsize not in PORTABLE_SIZES[dt.kind]:
        raise ConfigError(
            f"{where}: dtype {dt.str!r} cannot be encoded: its meaning depends on the "
            "platform (long double); use float64/complex128 (f8, c16) or smaller"
        )
    if arr.ndim > MAX_NDIM:
        raise ConfigError(f"{where}: {arr.ndim} dimensions, at most {MAX_NDIM}")
    desc: dict[str, Any] = {"dtype": dt.str, "shape": list(arr.shape), "off": 0, "len": arr.nbytes}
    if isinstance(value, np.generic):
        desc["sc"] = True
    copies.append((arr, desc))
    return desc


def check_value(value: Any, where: str, depth: int = 0) -> None:
    """Check that ``value`` is a plain msgpack value batchq can round trip.

    Allowed: ``None``, ``bool``, ``int`` (64-bit range), ``float``, ``str``, ``bytes``,
    ``bytearray``, and lists, tuples and dicts (str or bytes keys) of those. Tuples decode
    as lists, bytearrays as bytes.

    Raises:
        ConfigError: naming the offending type and where it sits.
    """
    if isinstance(value, str):
        if not value.isascii():  # isascii is a flag check; only lone surrogates fail here
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{where}: str {short(value)} is not valid unicode: {e}") from e
        return
    if value is None or isinstance(value, bool | float | bytes | bytearray):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ConfigError(f"{where}: integer {value} does not fit in 64 bits")
        return
    if depth >= MAX_VALUE_DEPTH:
        raise ConfigError(f"{where}: value nests deeper than {MAX_VALUE_DEPTH} levels")
    if isinstance(value, list | tuple):
        for i, elem in enumerate(value):
            check_value(elem, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, elem in value.items():
            if not isinstance(key, str | bytes):
                raise ConfigError(
                    f"{where}: dict key {key!r} of type {type(key).__name__}; keys must be str"
                )
            check_value(elem, f"{where}[{key!r}]", depth + 1)
        return
    raise ConfigError(
        f"{where}: cannot encode a value of type {type(value).__module__}."
        f"{type(value).__qualname__}; use an np.ndarray or None/bool/int/float/str/bytes "
        "and lists/dicts of those"
    )


# One kind per Python or numpy scalar type a list may hold, checked in this order (bool
# is an int, and numpy's float64 a float): the kind numpy's array of such leaves has.
_LEAF_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((bool, np.bool_), "b"),
    ((int, np.integer), "i"),
    ((float, np.floating), "f"),
    ((complex, np.complexfloating), "c"),
    ((str, np.str_), "U"),
)
# The array kinds a leaf kind allows (a list of Python ints above 2**63 is uint64).
_ARRAY_KINDS = {"b": "b", "i": "iu", "f": "f", "c": "c", "U": "U"}


def _leaf_kind(cls: type) -> str | None:
    for types, kind in _LEAF_KINDS:
        if issubclass(cls, types):
            return kind
    return None


def _leaves(value: list[Any] | tuple[Any, ...]) -> tuple[list[Any], set[type]] | None:
    """The innermost elements of nested lists and tuples (arrays count as leaves) and
    their types, or None when lists and other values share a level (ragged), a level
    is empty, or it nests deeper than an array may."""
    level = list(value)
    for _ in range(MAX_NDIM):
        types = set(map(type, level))  # per type, not per element: lists of 10**5 leaves
        nested = {issubclass(t, list | tuple) for t in types}
        if nested == {False}:
            return level, types
        if nested != {True}:  # empty, or lists beside other values
            return None
        level = list(itertools.chain.from_iterable(level))
    return None


def array_or_value(value: Any) -> Any:
    """A source's value as a producer sends it: a list or tuple that numpy turns into a
    regular array of one plain kind travels as that array, as Fuel's server sent it
    (``send_arrays``: ``numpy.ascontiguousarray``); anything else is returned unchanged
    (it travels as a msgpack value, or is refused by :func:`check_value`).

    A list converts only where the array holds exactly its values: every leaf of one
    kind (all bools, all ints, all floats, all complex numbers or all str; numpy scalars
    and arrays of those kinds count as theirs), the array of that kind (no int list
    made float, no mixed list made str), of a dtype a frame may carry, with no str
    ending in NUL (numpy drops trailing NULs). Scalars, dicts, bytes, empty, ragged
    or mixed lists, and lists holding None or masked arrays are left alone.
    """
    if not isinstance(value, list | tuple):
        return value
    found = _leaves(value)
    if found is None:
        return value
    leaves, types = found
    kinds: set[str | None] = set()
    for cls in types:
        if cls is np.ndarray:
            kinds |= {_leaf_kind(a.dtype.type) for a in leaves if type(a) is np.ndarray}
        else:
            kinds.add(_leaf_kind(cls))
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind is None:
        return value
    if kind == "U" and any(isinstance(s, str) and s.endswith("\0") for s in leaves):
        return value
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged below the leaves' level
        return value
    dt = arr.dtype
    if (
        dt.kind not in _ARRAY_KINDS[kind]
        or arr.ndim > MAX_NDIM
        or (dt.kind in PORTABLE_SIZES and dt.itemsize not in PORTABLE_SIZES[dt.kind])
    ):
        return value
    return arr


# --------------------------------------------------------------------------- decoding


def _bad(reason: str, where: str, detail: str) -> FrameError:
    return FrameError(reason, f"{where}: {detail}")


@functools.lru_cache(maxsize=256)
def _parse_dtype(text: str) -> np.dtype[Any] | None:
    # None for "not allowed"; the caller builds the error (lru_cache does not cache raises).
    if not _DTYPE_RE.fullmatch(text):
        return None
    try:
        dt = np.dtype(text)
    except Exception:  # numpy's parser raises TypeError or ValueError; never let it out
        return None
    if dt.kind not in ALLOWED_KINDS or dt.itemsize == 0 or dt.str != text:
        return None
    return dt


def _parse_shape(raw: Any, itemsize: int, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_NDIM:
        raise _bad(
            "bad_shape", where, f"shape {short(raw)}: expected a list of at most {MAX_NDIM} ints"
        )
    for d in raw:
        if type(d) is not int or d < 0:
            raise _bad(
                "bad_shape", where, f"shape {short(raw)}: entry {short(d)} is not an int >= 0"
            )
    if math.prod(max(d, 1) for d in raw) * itemsize > _MAX_EXTENT:
        raise _bad("bad_shape", where, f"shape {short(raw)} is too large")
    return tuple(raw)


def parse_item(entry: Any, where: str, data_start: int, size: int) -> Spec:
    """Validate one header item entry.

    Args:
        entry: the decoded msgpack value of the entry.
        where: names the item in error messages.
        data_start: where the buffer region begins (no array may start before).
        size: the frame's length in bytes.

    Raises:
        FrameError: the entry is malformed (``bad_header``, ``bad_dtype``, ``bad_shape``,
            ``bad_range``).
    """
    if isinstance(entry, dict) and entry.keys() == {"obj", "items"}:
        shape = _parse_shape(entry["obj"], 8, where)
        elems = entry["items"]
        if not isinstance(elems, list) or len(elems) != math.prod(shape):
            raise _bad(
                "bad_shape",
                where,
                f"object array of shape {list(shape)} needs "
                f"{math.prod(shape)} items, got {short(elems)}",
            )
        parsed = tuple(
            _parse_elem(e, f"{where} element {i}", data_start, size) for i, e in enumerate(elems)
        )
        return ObjectSpec(shape, parsed)
    return _parse_elem(entry, where, data_start, size)


def _parse_elem(entry: Any, where: str, data_start: int, size: int) -> ArraySpec | ValueSpec:
    if not isinstance(entry, dict):
        raise _bad("bad_header", where, f"item entry is a {type(entry).__name__}, expected a map")
    keys = entry.keys()
    if keys == {"v"}:
        return ValueSpec(entry["v"])
    if keys != _ARRAY_KEYS and keys != _SCALAR_KEYS:
        raise _bad(
            "bad_header",
            where,
            f"item keys {sorted(map(repr, keys))}; expected "
            "{dtype, shape, off, len[, sc]}, {v} or {obj, items}",
        )
    text = entry["dtype"]
    dt = _parse_dtype(text) if isinstance(text, str) and len(text) <= 32 else None
    if dt is None:
        raise _bad(
            "bad_dtype",
            where,
            f"dtype {short(text)}: expected a numpy dtype string of kind "
            f"{''.join(sorted(ALLOWED_KINDS))} (no object, void or structured dtypes)",
        )
    shape = _parse_shape(entry["shape"], dt.itemsize, where)
    off, length, scalar = entry["off"], entry["len"], entry.get("sc", False)
    if type(length) is not int or length != math.prod(shape) * dt.itemsize:
        raise _bad(
            "bad_shape",
            where,
            f"len {short(length)} != {math.prod(shape)} elements of shape "
            f"{list(shape)} x itemsize {dt.itemsize}",
        )
    if (scalar is not True and scalar is not False) or (scalar and shape):
        raise _bad("bad_header", where, f"sc {short(scalar)}: expected true on a 0-d array")
    if type(off) is not int or off % ALIGN or off < data_start or off + length > size:
        raise _bad(
            "bad_range",
            where,
            f"bytes [{short(off)}, +{length}) are not a 64-aligned range inside "
            f"the buffer region [{data_start}, {size})",
        )
    return ArraySpec(dt, shape, off, length, scalar)


def build_item(spec: Spec, buf: Any, writable: bool) -> Any:
    """Turn a validated spec into its value.

    Arrays are read-only views over ``buf`` unless ``writable``, which returns copies.
    """
    if isinstance(spec, ValueSpec):
        return spec.value
    if isinstance(spec, ArraySpec):
        return _build_array(spec, buf, writable)
    out = np.empty(spec.shape, dtype=object)
    flat = out.reshape(-1)  # a view: the new array is C-contiguous
    for i, elem in enumerate(spec.elems):
        flat[i] = build_item(elem, buf, writable)
    return out


def _build_array(spec: ArraySpec, buf: Any, writable: bool) -> Any:
    if spec.length == 0:
        # np.frombuffer cannot express every zero-size shape; nothing is shared anyway.
        arr = np.empty(spec.shape, dtype=spec.dtype)
    else:
        count = spec.length // spec.dtype.itemsize
        arr = np.frombuffer(buf, dtype=spec.dtype, count=count, offset=spec.off)
        arr = arr.reshape(spec.shape)
        if writable:
            arr = arr.copy()
    if not writable:
        arr.flags.writeable = False  # also for bytearray/memoryview input: one rule
    return arr[()] if spec.scalar else arr
