"""What a frame is: its kinds, the decoded :class:`Frame`, the encoders' input
(:class:`FrameHeader`) and the header map made of it (:func:`header_fields`), the rules
a header's fields obey, an encoded frame as the buffers that go to the socket back to
back (:class:`Pieces`), and the *reference* element a data list holds in place of a
frame stored under its own Redis key (:func:`encode_ref`, :func:`decode_ref`).

The wire layout is :mod:`batchq.wire.codec`'s (which re-exports everything here but
:class:`Pieces` and the references); both its encoder (which raises ConfigError) and
its decoder (FrameError) check headers with :func:`header_problem`, so that both sides
hold the same rules. The connection's packer (:mod:`batchq.client.redis_internals`)
writes a :class:`Pieces` argument as one bulk string, without joining its buffers.

A reference is ``REF_MAGIC + key`` (the key's UTF-8 bytes, at most 1024 of them,
printable, without spaces). The producer SETs a large frame under
``bq:{Q}:frame:<run>:<producer>:<n>`` (:mod:`batchq.protocol.keys`) and pushes its reference;
the trainer checks that the key is one of this queue's frame keys before reading it, so
a hostile element can never make it read (or delete) another key.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchq.errors import ConfigError, FrameError
from batchq.wire.values import short

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "MAGIC",
    "REF_MAGIC",
    "Frame",
    "FrameHeader",
    "FrameKind",
    "Pieces",
    "decode_ref",
    "encode_ref",
    "header_fields",
    "header_problem",
    "is_int",
    "is_ref",
]

MAGIC = b"BQF"
FORMAT_VERSION = 1


class FrameKind(enum.IntEnum):
    """What a frame carries."""

    BATCH = 1
    END = 2
    ERROR = 3


KINDS = frozenset(FrameKind)  # IntEnum members hash like their ints: `byte in KINDS`


@dataclass(frozen=True, eq=False)  # eq=False: data holds arrays, whose == is elementwise
class Frame:
    """A decoded frame.

    Attributes:
        kind: BATCH, END or ERROR.
        run: the run id.
        epoch: the epoch.
        shard: the shard's index inside the epoch.
        k: the batch's position in its shard.
        g: the global batch index in plan order, -1 when unknown.
        producer: the producer's id.
        last: whether this is the shard's last frame.
        count: the number of batches in the shard when ``last``, else None.
        sources: the source names.
        data: the decoded values, in ``sources`` order.
        error: the producer's traceback text (ERROR frames), else None.
        error_name: the exception's class name (ERROR frames), else None.
        nbytes: the encoded frame's length.
        produced_at: the producer's wall time at encoding, if it sent one.
        params_version: the version of the run's params log in effect at the batch's
            global index when it was built (0: no change applies; see
            :mod:`batchq.protocol.params_log`).
    """

    kind: FrameKind
    run: str
    epoch: int
    shard: int
    k: int
    g: int
    producer: str
    last: bool
    count: int | None
    sources: tuple[str, ...]
    data: tuple[Any, ...]
    error: str | None
    error_name: str | None
    nbytes: int
    produced_at: float | None
    params_version: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Return the data as a dict from source name to value."""
        return dict(zip(self.sources, self.data, strict=True))


@dataclass(frozen=True)
class FrameHeader:
    """What a frame says about itself, everything but its arrays (the encoders' input).

    Attributes:
        kind: BATCH, END or ERROR. END implies ``last=True``; END and ERROR carry no data.
        run: the run id.
        epoch: the epoch (>= 0).
        shard: the shard's index (>= 0).
        k: the batch's position in its shard (>= 0).
        producer: the producer's id.
        sources: the source names, unique; one value per source in the data.
        g: the global batch index, -1 when unknown.
        last: whether this is the shard's last frame; then ``count`` is required.
        count: the number of batches in the shard (only with ``last``).
        error: the traceback text (ERROR frames; required there).
        error_name: the exception's class name (ERROR frames).
        produced_at: the producer's wall time, for monitoring.
        params_version: the params log's version in effect at the batch's global index
            (0: none), by which the trainer tells a batch built before a change.
    """

    kind: FrameKind
    run: str
    epoch: int
    shard: int
    k: int
    producer: str
    sources: Sequence[str] = ()
    g: int = -1
    last: bool = False
    count: int | None = None
    error: str | None = None
    error_name: str | None = None
    produced_at: float | None = None
    params_version: int = 0


class Pieces:
    """One Redis value sent as several buffers, back to back, without joining them.

    A command argument of this type is written as one bulk string (its total length,
    then each buffer as it is): a frame's header and its arrays' own memory go to the
    socket without being copied into one buffer first.

    Args:
        buffers: the value's parts, in order (bytes, or byte-format memoryviews).
        nbytes: their total length.
    """

    def __init__(self, buffers: list[bytes | memoryview], nbytes: int) -> None:
        self.buffers = buffers
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(bytes(b) for b in self.buffers)

    def __repr__(self) -> str:
        return f"Pieces({len(self.buffers)} buffers, {self.nbytes} bytes)"


def header_fields(spec: FrameHeader, kind: FrameKind) -> dict[str, Any]:
    """The header map of ``spec`` (its ``kind`` checked) but its items, optional fields
    only when set, checked by the rules both sides hold (:func:`header_problem`): the
    encoder's header.

    Raises:
        ConfigError: a field breaks a rule.
    """
    header: dict[str, Any] = {
        "run": spec.run, "ep": _plain(spec.epoch), "sh": _plain(spec.shard),
        "k": _plain(spec.k), "g": _plain(spec.g), "pid": spec.producer,
        "last": True if kind is FrameKind.END else spec.last, "src": list(spec.sources),
    }  # fmt: skip
    pv = _plain(spec.params_version) or None  # absent means 0: small frames stay small
    optional = {
        "n": _plain(spec.count), "err": spec.error, "ename": spec.error_name,
        "t": spec.produced_at, "pv": pv,
    }  # fmt: skip
    header.update((key, value) for key, value in optional.items() if value is not None)
    problem = header_problem(kind, header)
    if problem:
        raise ConfigError(f"cannot encode the frame: {problem}")
    if spec.produced_at is not None:
        header["t"] = float(spec.produced_at)
    return header


def _plain(value: Any) -> Any:
    # Coordinates often come out of numpy arithmetic; msgpack only packs Python ints.
    return int(value) if isinstance(value, np.integer) else value


def is_int(value: Any, low: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``low``."""
    return type(value) is int and value >= low


_FIELDS: dict[str, tuple[str, type]] = {
    "run": ("run id", str), "ep": ("epoch", int), "sh": ("shard", int), "k": ("k", int),
    "g": ("g", int), "pid": ("producer", str), "last": ("last", bool), "src": ("sources", list),
}  # fmt: skip
_LOW = {"ep": 0, "sh": 0, "k": 0, "g": -1}


def header_problem(kind: FrameKind, header: dict[Any, Any]) -> str | None:
    """Say what is wrong with a header's fields (not its items), or None.

    Shared by the encoder (which raises ConfigError) and the decoder (FrameError), so
    that both sides hold the same rules. The first problem found is said: the fields'
    types and bounds, then the sources and the count, then the error fields and time.
    """
    return (
        _typed_problem(header)
        or _content_problem(kind, header)
        or _error_problem(kind, header)
        or _time_problem(header)
        or _params_problem(header)
    )


def _typed_problem(header: dict[Any, Any]) -> str | None:
    """A required field of the wrong type, or below its bound."""
    for key, (name, typ) in _FIELDS.items():
        value = header.get(key)
        # bool is an int subclass: only "last" may be one.
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            return f"{key!r} ({name}) is {short(value)}, expected a {typ.__name__}"
        if key in _LOW and header[key] < _LOW[key]:
            return f"{key!r} ({name}) is {value}, expected >= {_LOW[key]}"
    return None


def _content_problem(kind: FrameKind, header: dict[Any, Any]) -> str | None:
    """Sources that are not unique strs, a count without last (or the reverse), or
    sources on a frame that carries no data (the fields' types are right)."""
    src = header["src"]
    if not all(isinstance(s, str) for s in src) or len(set(src)) != len(src):
        return f"'src' (sources) is {short(src)}, expected unique strs"
    last, count = header["last"], header.get("n")
    if last != ("n" in header) or (last and not is_int(count, 0)):
        return f"'n' (count) is {short(count)} with last={last}; expected an int >= 0 iff last"
    if kind is not FrameKind.BATCH and src:
        return f"{kind.name} frames carry no data, got sources {short(src)}"
    return None


def _error_problem(kind: FrameKind, header: dict[Any, Any]) -> str | None:
    """An ERROR frame without its traceback text, error fields on another kind, or an
    error name that is not a str."""
    err, ename = header.get("err"), header.get("ename")
    if kind is FrameKind.ERROR and not isinstance(err, str):
        return f"'err' (error) is {short(err)}; ERROR frames need the traceback text"
    if kind is not FrameKind.ERROR and (err is not None or ename is not None):
        return f"'err'/'ename' (error, error_name) belong to ERROR frames, not {kind.name}"
    if ename is not None and not isinstance(ename, str):
        return f"'ename' (error_name) is {short(ename)}, expected a str"
    return None


def _params_problem(header: dict[Any, Any]) -> str | None:
    """A params version that is not an int >= 0 (absent: 0)."""
    pv = header.get("pv", 0)
    return None if is_int(pv, 0) else f"'pv' (params_version) is {short(pv)}, expected an int >= 0"


def _time_problem(header: dict[Any, Any]) -> str | None:
    """A producer time that is not a number."""
    t = header.get("t")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)):
        return f"'t' (produced_at) is {short(t)}, expected a float"
    return None


# -- references: a frame stored under its own key ------------------------------------

REF_MAGIC = b"BQR\x01"
_MAX_REF_KEY = 1024  # bytes; a reference names a Redis key, not a payload


def encode_ref(key: str) -> bytes:
    """Encode a reference element that points at the Redis key holding a large frame.

    Raises:
        ConfigError: the key is empty, too long, or contains whitespace/control chars.
    """
    if not isinstance(key, str) or not _key_ok(key):
        raise ConfigError(f"reference key {key!r}: expected a printable str without spaces")
    encoded = key.encode("utf-8")
    if len(encoded) > _MAX_REF_KEY:
        raise ConfigError(f"reference key of {len(encoded)} bytes, at most {_MAX_REF_KEY}")
    return REF_MAGIC + encoded


def decode_ref(elem: bytes | bytearray | memoryview, key_prefix: str) -> str:
    """Decode a reference element and check that it names a key of this queue.

    Args:
        elem: the list element.
        key_prefix: the prefix every frame key of this queue starts with.

    Returns:
        The key.

    Raises:
        FrameError: ``bad_ref`` when the element is not a valid reference under
            ``key_prefix``.
    """
    if not is_ref(elem):
        raise FrameError("bad_ref", f"starts with {bytes(elem[:4])!r}, expected {REF_MAGIC!r}")
    raw = bytes(elem[len(REF_MAGIC) :])
    if len(raw) > _MAX_REF_KEY:
        raise FrameError("bad_ref", f"key of {len(raw)} bytes, at most {_MAX_REF_KEY}")
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("bad_ref", f"key {raw[:64]!r} is not utf-8") from None
    if not _key_ok(key) or not key.startswith(key_prefix):
        raise FrameError(
            "bad_ref", f"key {key[:200]!r}: expected a printable key starting with {key_prefix!r}"
        )
    return key


def _key_ok(key: str) -> bool:
    # isprintable() is False for control, format and separator characters except " ".
    return bool(key) and key.isprintable() and " " not in key


def is_ref(elem: Any) -> bool:
    """Whether ``elem`` looks like a reference element (a cheap prefix check)."""
    return isinstance(elem, bytes | bytearray | memoryview) and bytes(elem[:4]) == REF_MAGIC
