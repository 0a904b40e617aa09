"""A source's value as a frame's item: the header entry that describes it, and the copies
of its arrays' bytes into the frame's buffer region (:func:`encode_item`); a value that
is not an array is checked to be plain msgpack data (:func:`check_value`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from batchq.wire.values import ALLOWED_KINDS, MAX_NDIM, MAX_VALUE_DEPTH, PORTABLE_SIZES, Copy, short

__all__ = ["check_value", "encode_item"]


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
