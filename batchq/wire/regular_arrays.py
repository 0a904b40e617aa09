"""A batch of lists that numpy turns into a regular array, sent as that array (as Fuel's
server did: its ``send_arrays`` made every batch a contiguous array).

:func:`array_or_value` looks at the leaves of nested lists and tuples: all of one
plain kind (bools, ints, floats, complex, str) and a regular shape make one array;
anything else stays the value it is (a msgpack value, or refused by
:func:`batchq.wire.items.check_value`).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from batchq.wire.values import MAX_NDIM, PORTABLE_SIZES

__all__ = ["array_or_value"]


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
