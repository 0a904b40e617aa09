"""What the reader thread does to each frame before the trainer sees it.

The trainer's ``sources`` say what comes and in which order (Fuel's contract): the
producers' values are picked and reordered by name, a subset is fine, and a name the
producers do not serve raises, naming those they do. Declared ``dtypes`` are guaranteed:
a value of another dtype is cast here, on the reader thread, and the trainer is warned
once per source (the warnings are handed to the iterator, so that they are raised on the
training thread, where filters and ``pytest.warns`` see them). With ``writable`` the
arrays of a frame received into a buffer of its own are made writable in place: no copy.

What the arrays may be (:class:`ArrayAccess`) is decided once, here: the reader and the
shared-memory mapping read it from the stream's one ``FramePrep`` when reading starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from batchq.wire.codec import Frame, FrameKind
from batchq.wire.values import ALLOWED_KINDS

__all__ = ["ArrayAccess", "FramePrep", "check_dtypes", "decode_axis_labels", "make_writable"]

log = logging.getLogger(__name__)

# A hook run on the reader thread after FramePrep (the torch adapter's pinned copies).
FrameHook = Callable[[Frame], Frame]


class ArrayAccess(enum.Enum):
    """What the arrays a trainer receives may be, and what that costs.

    Attributes:
        READ_ONLY: read-only views over the received bytes (no copy anywhere).
        WRITABLE: writable arrays that own their memory (``writable=True``): frames stored
            by reference are received into buffers of their own, smaller frames are
            copied once, a shared-memory batch is copied out and its segment released.
        VIEWS: as WRITABLE, except that a shared-memory batch stays in its segment as
            writable views, held while referenced (the torch adapter's zero-copy tensors).
    """

    READ_ONLY = "read-only"
    WRITABLE = "writable"
    VIEWS = "views"

    @property
    def owns_memory(self) -> bool:
        """Whether frames from Redis are received into (or copied to) memory of their own."""
        return self is not ArrayAccess.READ_ONLY


def check_dtypes(dtypes: Mapping[str, Any] | None) -> dict[str, np.dtype[Any]]:
    """Validate ``dtypes`` (source -> numpy dtype or its name) into numpy dtypes.

    Raises:
        ConfigError: not a mapping of names to plain-data dtypes.
    """
    if dtypes is None:
        return {}
    if not isinstance(dtypes, Mapping):
        raise ConfigError(
            f"dtypes {dtypes!r} is not valid: expected a dict source -> dtype, "
            "e.g. {'features': 'float32'}"
        )
    out: dict[str, np.dtype[Any]] = {}
    for source, wanted in dtypes.items():
        if not isinstance(source, str):
            raise ConfigError(f"dtypes key {source!r} is not valid: expected a source name")
        try:
            dtype = np.dtype(wanted)
        except TypeError:
            raise ConfigError(
                f"dtypes[{source!r}] = {wanted!r} is not valid: expected a numpy dtype "
                "such as 'float32'"
            ) from None
        if dtype.kind not in ALLOWED_KINDS:
            raise ConfigError(
                f"dtypes[{source!r}] = {wanted!r} is not valid: expected a plain-data dtype "
                f"(kinds {''.join(sorted(ALLOWED_KINDS))}), not {dtype.str}"
            )
        out[source] = dtype
    return out


def make_writable(value: Any) -> Any:
    """Make the arrays in ``value`` writable in place where their memory allows it.

    Arrays decoded from a buffer the trainer owns are read-only views only because the
    codec marks every view so; the memory is theirs, nothing else reads it.
    """
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            for elem in value.reshape(-1):
                make_writable(elem)
        elif not value.flags.writeable:
            # Immutable memory (bytes) refuses: such frames were copied by the codec.
            with contextlib.suppress(ValueError):
                value.flags.writeable = True
    return value


class FramePrep:
    """Selects, reorders and casts a frame's values (called on the reader thread).

    Args:
        sources: the trainer's sources, in the order it wants them; None takes the
            producers' sources as they come.
        dtypes: source -> the dtype the trainer receives.
        queue: the queue's name, for messages.
        writable: make the arrays of frames in buffers of their own writable
            (:attr:`ArrayAccess.WRITABLE`; :meth:`set_access` changes it before reading).
    """

    def __init__(
        self,
        sources: Sequence[str] | None,
        dtypes: Mapping[str, Any] | None,
        queue: str,
        *,
        writable: bool = False,
    ) -> None:
        self.sources = None if sources is None else tuple(sources)
        self.dtypes = check_dtypes(dtypes)
        self._check_dtype_names(self.sources, self.dtypes)
        self.queue = queue
        self.access = ArrayAccess.WRITABLE if writable else ArrayAccess.READ_ONLY
        self.served: tuple[str, ...] | None = None  # the producers' sources, once seen
        self.hooks: list[FrameHook] = []
        self._changing_hooks = 0  # hooks that may change a frame's values
        # Some frame came out with other values than it was decoded with (a cast that
        # changed a dtype, a subset of its sources): written on the reader thread.
        self._changed = False
        self._index: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._pending: list[str] = []  # warnings for the training thread to raise

    @property
    def writable(self) -> bool:
        """Whether the arrays handed out are writable (any access but READ_ONLY)."""
        return self.access.owns_memory

    def set_sources(self, sources: Sequence[str]) -> None:
        """Change the sources (before reading starts): the dtypes must name some of them."""
        wanted = tuple(sources)
        self._check_dtype_names(wanted, self.dtypes)
        self.sources = wanted
        self._index.clear()

    def add_dtypes(self, dtypes: Mapping[str, Any]) -> None:
        """Declare more dtypes (before reading starts); a source named again is replaced."""
        merged = dict(self.dtypes)
        merged.update(check_dtypes(dtypes))
        self._check_dtype_names(self.sources, merged)
        self.dtypes = merged

    def add_hook(self, hook: FrameHook, *, keeps_values: bool = False) -> None:
        """Run ``hook`` on the reader thread on every batch frame, after the casts;
        ``keeps_values``: it returns the same values (copied into other memory, as the
        torch adapter's pinned copies)."""
        self.hooks.append(hook)
        self._changing_hooks += not keeps_values

    def set_access(self, access: ArrayAccess) -> None:
        """What the arrays handed out may be (before reading starts)."""
        if not isinstance(access, ArrayAccess):
            raise ConfigError(f"access {access!r} is not valid: expected an ArrayAccess")
        self.access = access

    @staticmethod
    def _check_dtype_names(
        sources: tuple[str, ...] | None, dtypes: Mapping[str, np.dtype[Any]]
    ) -> None:
        if sources is None:
            return
        unknown = [s for s in dtypes if s not in sources]
        if unknown:
            raise ConfigError(
                f"dtypes names {unknown!r}, which are not among the stream's sources {sources!r}"
            )

    def __call__(self, frame: Frame) -> Frame:
        if frame.kind is not FrameKind.BATCH:
            return frame
        names, data = self._select(frame)
        if len(names) != len(frame.sources):
            self._changed = True  # a subset: the rest is not given back
        for pos, name in enumerate(names):
            wanted = self.dtypes.get(name)
            if wanted is not None:
                data[pos] = self._cast(name, data[pos], wanted)
            elif self.writable:
                make_writable(data[pos])
        if names != frame.sources or any(a is not b for a, b in zip(data, frame.data, strict=True)):
            frame = dataclasses.replace(frame, sources=names, data=tuple(data))
        for hook in self.hooks:
            frame = hook(frame)
        return frame

    def keeps_frames(self) -> bool:
        """Whether every frame so far came out with the values it was decoded with:
        every source served (the order aside: names travel with the values), no cast that
        changed a dtype, no hook but those that keep values (a detaching trainer gives
        back only such frames)."""
        return not self._changed and not self._changing_hooks

    def _select(self, frame: Frame) -> tuple[tuple[str, ...], list[Any]]:
        """The trainer's sources and the frame's values of them, in the trainer's order."""
        index = self._index.get(frame.sources)
        if index is None:
            index = self._index[frame.sources] = self._resolve(frame.sources)
        names = self.sources if self.sources is not None else frame.sources
        return names, [frame.data[i] for i in index]

    def take_warnings(self) -> list[str]:
        """The cast warnings not yet raised (the iterator raises them)."""
        if not self._pending:
            return []
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def _resolve(self, served: tuple[str, ...]) -> tuple[int, ...]:
        self.served = served
        if self.sources is None:
            unknown = [s for s in self.dtypes if s not in served]
            wanted: tuple[str, ...] = served
        else:
            unknown = [s for s in self.sources if s not in served]
            wanted = self.sources
        if unknown:
            raise ConfigError(
                f"queue {self.queue}: the trainer asked for source(s) "
                f"{', '.join(map(repr, unknown))}, but the producers serve {list(served)}"
            )
        return tuple(served.index(s) for s in wanted)

    def _cast(self, name: str, value: Any, wanted: np.dtype[Any]) -> Any:
        if isinstance(value, np.ndarray) and value.dtype == object:
            out = np.empty(value.shape, dtype=object)
            flat = out.reshape(-1)
            for i, elem in enumerate(value.reshape(-1)):
                flat[i] = self._cast(name, elem, wanted)
            return out
        if isinstance(value, np.ndarray | np.generic):
            if value.dtype == wanted:
                return make_writable(value) if self.writable else value
            self._warn_once(name, value.dtype, wanted)
            self._changed = True
            return value.astype(wanted)
        if isinstance(value, bool | int | float | complex):
            self._changed = True
            return np.asarray(value, dtype=wanted)[()]
        raise ConfigError(
            f"queue {self.queue}: source {name!r} holds a {type(value).__name__}, which "
            f"cannot be cast to the declared dtype {wanted}"
        )

    def _warn_once(self, name: str, got: np.dtype[Any], wanted: np.dtype[Any]) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        with self._lock:
            self._pending.append(
                f"queue {self.queue}: source {name!r} arrives as {got} and is cast to the "
                f"declared {wanted} on the reader thread (warned once per source)"
            )


_MAX_AXIS_LABELS_BYTES = 64 * 1024


def decode_axis_labels(raw: bytes | None, sources: Sequence[str]) -> dict[str, Any] | None:
    """The producers' axis labels from the queue's meta (JSON: source -> names or null).

    Only the trainer's sources are kept. Anything malformed or oversized is ignored with
    a warning (labels are a convenience; data never depends on them): None.
    """
    if raw is None:
        return None
    if len(raw) > _MAX_AXIS_LABELS_BYTES:
        log.warning("axis labels of %d bytes ignored (at most 64 KiB)", len(raw))
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        log.warning("axis labels %r ignored: not JSON", raw[:80])
        return None
    if not _labels_shape(value):
        log.warning("axis labels %r ignored: expected source -> list of names", raw[:80])
        return None
    wanted = tuple(sources) or tuple(value)
    return {s: None if value.get(s) is None else tuple(value[s]) for s in wanted if s in value}


def _labels_shape(value: Any) -> bool:
    """Whether decoded axis labels are source -> None or a list of names."""
    return isinstance(value, dict) and all(
        isinstance(k, str)
        and (v is None or (isinstance(v, list) and all(isinstance(a, str) for a in v)))
        for k, v in value.items()
    )
