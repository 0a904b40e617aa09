"""One cache entry: an example (arrays, dicts and tuples of them, scalars) as a frame.

An entry is a batchq frame (:mod:`batchq.wire.codec`, with its crc32 over every byte):
its ``run`` is the stage's fingerprint, its ``k`` the example's index, its first source
``tree`` a msgpack value describing the example's structure, and each further source
one of the example's arrays. Decoding checks the prefix, the header, the crc, the
fingerprint and the index, so a torn, corrupted or foreign entry is refused (a
:class:`~batchq.errors.FrameError`: the cache builds the example again), never served;
nothing in an entry is ever executed (no pickle).

The tree is nested lists: ``["t", [...]]`` a tuple, ``["l", [...]]`` a list, ``["d",
[[key, node], ...]]`` a dict (str keys, in order), ``["v", value]`` a plain value (None,
bool, int, float, str, bytes), ``["a", i, perm]`` the array of source ``a<i>``, and
``[tag, i, perm]`` an array that a *leaf codec* restores (torch's tensors:
:mod:`producer.torch.cache`). ``perm`` keeps an array's memory order: a transposed view
(a CHW tensor made from an HWC image) is stored in its own order and transposed back on
read, so the example read is laid out as the one built (some kernels pick their path by
layout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchq.errors import ConfigError, FrameError
from batchq.wire.codec import FrameHeader, FrameKind, decode_frame, encode_frame_pieces
from batchq.wire.frame import Pieces

__all__ = ["NUMPY_ONLY", "LeafCodec", "decode_entry", "encode_entry", "memory_order"]

_PRODUCER = "cache"
_TREE = "tree"


@dataclass(frozen=True)
class LeafCodec:
    """How leaves that are not numpy arrays are stored (torch's tensors).

    Attributes:
        to_array: ``leaf`` -> (its tag, the array that holds its values), or None when
            ``leaf`` is not one of this codec's.
        from_array: tag -> a function making the leaf from the (writable) array read.
    """

    to_array: Callable[[Any], tuple[str, np.ndarray[Any, Any]] | None]
    from_array: Mapping[str, Callable[[np.ndarray[Any, Any]], Any]] = field(default_factory=dict)


def _no_leaf(leaf: Any) -> None:
    return None


#: The codec of entries that hold numpy arrays only (no other leaves); its function a
#: module's, not a lambda: a stage is pickled into a DataLoader's spawned workers.
NUMPY_ONLY = LeafCodec(to_array=_no_leaf)


def memory_order(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], list[int]]:
    """(a C-contiguous array, perm) with ``stored.transpose(perm)`` equal to ``arr`` and
    laid out alike where ``arr`` is a transposed contiguous array; else (a C copy, the
    identity)."""
    ident = list(range(arr.ndim))
    if arr.flags.c_contiguous or arr.ndim < 2:
        return arr, ident
    strides = arr.strides
    order = sorted(ident, key=lambda d: -abs(strides[d]))
    base = arr.transpose(order)
    if not base.flags.c_contiguous:
        return np.ascontiguousarray(arr), ident
    perm = ident[:]  # the inverse of order (numpy's argsort: a few us more an entry)
    for place, dim in enumerate(order):
        perm[dim] = place
    return base, perm


def encode_entry(
    value: Any, fingerprint: str, index: int, leaves: LeafCodec = NUMPY_ONLY
) -> Pieces:
    """The entry of example ``index`` of the stage ``fingerprint``, as the buffers to write
    back to back (the header, then the arrays' own memory: nothing is copied; measured,
    the copy into one buffer was half of an image entry's encoding).

    Raises:
        ConfigError: ``value`` holds something an entry cannot (names it and its place).
    """
    arrays: list[Any] = []
    tree = _node(value, arrays, leaves, "example", 0)
    sources = [_TREE, *(f"a{i}" for i in range(len(arrays)))]
    header = FrameHeader(
        kind=FrameKind.BATCH, run=fingerprint, epoch=0, shard=0, k=index,
        producer=_PRODUCER, sources=sources,
    )  # fmt: skip
    return encode_frame_pieces(header, [tree, *arrays], checksum=True)


def _node(value: Any, arrays: list[Any], leaves: LeafCodec, where: str, depth: int) -> Any:
    if depth > 32:
        raise ConfigError(f"{where}: the example nests deeper than 32 levels")
    if isinstance(value, np.ndarray | np.generic):
        return _array("a", value, arrays, where)
    coded = leaves.to_array(value)
    if coded is not None:
        return _array(coded[0], coded[1], arrays, where)
    if type(value) is tuple or type(value) is list:
        tag = "t" if type(value) is tuple else "l"
        return [
            tag,
            [_node(v, arrays, leaves, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)],
        ]
    if type(value) is dict:
        items = []
        for key, v in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"{where}: dict key {key!r} is not a str; a cache entry needs str keys"
                )
            items.append([key, _node(v, arrays, leaves, f"{where}[{key!r}]", depth + 1)])
        return ["d", items]
    if value is None or type(value) in (bool, int, float, str, bytes):
        return ["v", value]
    raise ConfigError(
        f"{where}: cannot cache a {type(value).__module__}.{type(value).__qualname__}: the "
        "cached stage must return numpy arrays or torch tensors, plain tuples, lists and "
        "dicts of them, and None/bool/int/float/str/bytes (end an image stage with "
        "v2.ToImage() or PILToTensor(), not a PIL image)"
    )


def _array(tag: str, arr: Any, arrays: list[Any], where: str) -> list[Any]:
    if isinstance(arr, np.generic):
        arrays.append(arr)
        return [tag, len(arrays) - 1, None]
    if arr.dtype.kind in "OV":
        raise ConfigError(f"{where}: an array of dtype {arr.dtype} cannot be cached")
    stored, perm = memory_order(arr)
    arrays.append(stored)
    return [tag, len(arrays) - 1, perm]


def decode_entry(
    buf: bytes | bytearray | memoryview,
    fingerprint: str,
    index: int,
    leaves: LeafCodec = NUMPY_ONLY,
) -> Any:
    """The example an entry holds, its arrays writable copies.

    Raises:
        FrameError: not a valid frame, a crc that does not match or is missing (the
            codec's reasons),
            another stage's or another index's entry (``foreign_entry``), or a tree
            that does not describe its sources (``bad_entry``).
    """
    frame = decode_frame(buf, writable=True, require_checksum=True)  # written with one
    if frame.run != fingerprint or frame.k != index or frame.producer != _PRODUCER:
        raise FrameError("foreign_entry", f"stage {frame.run[:16]}, index {frame.k}")
    if not frame.sources or frame.sources[0] != _TREE:
        raise FrameError("bad_entry", "an entry without its tree")
    try:
        return _build(frame.data[0], frame.data[1:], leaves, 0)
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise FrameError("bad_entry", f"its tree is malformed: {e}") from e


def _build(node: Any, arrays: tuple[Any, ...], leaves: LeafCodec, depth: int) -> Any:
    """A tree node: a value, a tuple, a list or a dict of nodes, or an array leaf."""
    if depth > 33 or not isinstance(node, list) or not node:
        raise ValueError(f"node {node!r:.80}")
    tag = node[0]
    if tag == "v" and len(node) == 2:
        return node[1]
    if tag in ("t", "l") and len(node) == 2:
        out = [_build(n, arrays, leaves, depth + 1) for n in node[1]]
        return tuple(out) if tag == "t" else out
    if tag == "d" and len(node) == 2:
        return {str(k): _build(n, arrays, leaves, depth + 1) for k, n in node[1]}
    return _leaf(node, arrays, leaves)


def _leaf(node: list[Any], arrays: tuple[Any, ...], leaves: LeafCodec) -> Any:
    """An array leaf ``[tag, source, permutation]``: the source's array, put back in its
    order, as the type its tag names (the fixed table of ``leaves``)."""
    tag = node[0]
    if len(node) != 3 or not isinstance(node[1], int) or isinstance(node[1], bool):
        raise ValueError(f"node {node!r:.80}")
    arr = arrays[node[1]]
    if node[2] is not None:
        if not isinstance(arr, np.ndarray) or sorted(node[2]) != list(range(arr.ndim)):
            raise ValueError(f"permutation {node[2]!r:.80} of an array of {np.ndim(arr)} dims")
        arr = arr.transpose(node[2])
    if tag == "a":
        return arr
    make = leaves.from_array.get(tag)
    if make is None:
        raise ValueError(f"leaf tag {tag!r:.20} is not known")
    return make(arr)
