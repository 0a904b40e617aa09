"""A source's value as a frame's item, and back.

Before encoding, a producer passes each value through :func:`array_or_value`: a batch of
lists that numpy turns into a regular array travels as that array (as Fuel's server did:
its ``send_arrays`` made every batch a contiguous array). It looks at the leaves of
nested lists and tuples: all of one plain kind (bools, ints, floats, complex, str) and a
regular shape make one array; anything else stays the value it is.

Encoding: the header entry that describes the value, and the copies of its arrays'
bytes into the frame's buffer region (:func:`encode_item`); a value that is not an
array is checked to be plain msgpack data (:func:`check_value`).

Decoding, in two passes so that nothing reaches numpy before the whole header has been
checked: :func:`parse_item` validates a header entry into a spec (only ``np.dtype`` on an
allow-listed string is called), and :func:`build_item` turns a spec into arrays with
``np.frombuffer``. Object bytes are never read: an object array travels as a list of its
elements, each an array or a msgpack value.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from typing import Any

import numpy as np

from batchq.errors import ConfigError, FrameError
from batchq.wire.values import (
    ALIGN,
    ALLOWED_KINDS,
    MAX_NDIM,
    MAX_VALUE_DEPTH,
    PORTABLE_SIZES,
    ArraySpec,
    Copy,
    ObjectSpec,
    Spec,
    ValueSpec,
    short,
)

__all__ = ["array_or_value", "build_item", "check_value", "encode_item", "parse_item"]

# ------------------------------------------------------------------ lists sent as arrays

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
    kind = _one_kind(*found) if found is not None else None
    arr = _exact_array(value, kind) if kind is not None else None
    return value if arr is None else arr


def _one_kind(leaves: list[Any], types: set[type]) -> str | None:
    """The one plain kind of every leaf (an array counts by its dtype), None where the
    leaves are of several kinds or of none (a str ending in NUL counts as none: numpy
    drops trailing NULs)."""
    kinds: set[str | None] = set()
    for cls in types:
        if cls is np.ndarray:
            kinds |= {_leaf_kind(a.dtype.type) for a in leaves if type(a) is np.ndarray}
        else:
            kinds.add(_leaf_kind(cls))
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind == "U" and any(isinstance(s, str) and s.endswith("\0") for s in leaves):
        return None
    return kind


def _exact_array(value: list[Any] | tuple[Any, ...], kind: str) -> np.ndarray | None:
    """numpy's array of ``value``, where it holds exactly its values: of the leaves'
    ``kind``, with at most MAX_NDIM dimensions, of a size every platform reads alike;
    None otherwise."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged below the leaves' level
        return None
    dt = arr.dtype
    if (
        dt.kind not in _ARRAY_KINDS[kind]
        or arr.ndim > MAX_NDIM
        or (dt.kind in PORTABLE_SIZES and dt.itemsize not in PORTABLE_SIZES[dt.kind])
    ):
        return None
    return arr


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
    # np.asarray would silently drop a mask. No masked array exists before numpy.ma is
    # imported, and reading np.ma imports it: 30 ms on a producer's first push.
    masked = sys.modules.get("numpy.ma")
    if masked is not None and isinstance(value, masked.MaskedArray):
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
    if _plain_scalar(value, where):
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


def _plain_scalar(value: Any, where: str) -> bool:
    """Whether ``value`` is a scalar msgpack value, checked (a str is valid unicode, an
    int fits in 64 bits); False for anything else (a container, another type)."""
    if isinstance(value, str):
        if not value.isascii():  # isascii is a flag check; only lone surrogates fail here
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{where}: str {short(value)} is not valid unicode: {e}") from e
        return True
    if value is None or isinstance(value, bool | float | bytes | bytearray):
        return True
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ConfigError(f"{where}: integer {value} does not fit in 64 bits")
        return True
    return False


# --------------------------------------------------------------------------- decoding


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

_ARRAY_KEYS = frozenset({"dtype", "shape", "off", "len"})
_SCALAR_KEYS = _ARRAY_KEYS | {"sc"}


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
    return _parse_array(entry, where, data_start, size)


def _parse_array(entry: dict[Any, Any], where: str, data_start: int, size: int) -> ArraySpec:
    """An array entry (its keys checked): its dtype, its shape, and its bytes' length
    and place inside the buffer region."""
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
    _check_range(off, length, where, data_start, size)
    return ArraySpec(dt, shape, off, length, scalar)


def _check_range(off: Any, length: int, where: str, data_start: int, size: int) -> None:
    """An array's bytes ``[off, off + length)`` are a 64-aligned range inside the buffer
    region ``[data_start, size)``."""
    if type(off) is not int or off % ALIGN or off < data_start or off + length > size:
        raise _bad(
            "bad_range",
            where,
            f"bytes [{short(off)}, +{length}) are not a 64-aligned range inside "
            f"the buffer region [{data_start}, {size})",
        )


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
