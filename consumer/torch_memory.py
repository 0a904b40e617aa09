"""Host and device memory for the torch adapter: a reused pool of pinned buffers, and
device copies on a side stream.

:class:`PinnedPool` hands out pinned byte buffers. A buffer goes back into use only when
nothing references its memory any more: the pool compares the storage's reference
count with the count it had when the buffer was free (a tensor, a view of it, or a
numpy array made from it all hold one), so a batch the trainer keeps is never
overwritten. The pool's allocator is a parameter, so that its bookkeeping is tested
with plain CPU tensors where no accelerator exists.

:class:`DeviceMover` copies a batch to a device with ``non_blocking=True`` on a stream of
its own and records an event after the copies; :meth:`DeviceMover.hand_over` makes the
consumer's current stream wait for that event (never the host) and records the tensors
on the consumer's stream, so the caching allocator does not reuse their memory while
the consumer's kernels may still read them. The host buffers a copy reads from are kept
until its event has completed (:meth:`DeviceMover.retire`). The stream API is taken from
the device's torch module (``torch.cuda``, ``torch.xpu``); ``torch.cpu`` has the same
API as a no-op stand-in, which is what the tests on CPU-only machines drive.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

__all__ = ["DeviceMover", "PinnedPool", "pinned_alloc", "to_tensor"]


def pinned_alloc(nbytes: int) -> torch.Tensor:
    """A pinned (page-locked) byte buffer for the current accelerator."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _use_count(buf: torch.Tensor) -> int:
    # References to the storage's memory, from any tensor or view (torch's own counter).
    return int(torch._C._storage_Use_Count(buf.untyped_storage()._cdata))


def to_tensor(value: Any) -> Any:
    """A numpy array as a tensor sharing its memory; anything torch cannot hold as is
    (strings, dates, objects, Python values) is returned unchanged."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        try:
            return torch.from_numpy(value)
        except TypeError:  # a dtype this torch does not map (e.g. non-native byte order)
            return value
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return torch.as_tensor(value)
    return value


class _Entry:
    __slots__ = ("baseline", "buf")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.baseline = _use_count(buf)

    def free(self) -> bool:
        return _use_count(self.buf) <= self.baseline


class PinnedPool:
    """A pool of pinned host buffers, reused once nothing references them.

    Args:
        alloc: makes a buffer of n bytes (default: pinned memory); tests pass a plain
            ``torch.empty`` to check the bookkeeping without an accelerator.
        max_buffers: the most buffers kept; past that a batch gets a buffer of its own,
            released with it (the trainer is holding many batches).
    """

    def __init__(
        self, alloc: Callable[[int], torch.Tensor] | None = None, max_buffers: int = 64
    ) -> None:
        self._alloc = alloc or pinned_alloc
        self.max_buffers = max_buffers
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated for the pool (figures, tests)
        self.reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, nbytes: int) -> torch.Tensor:
        """A byte tensor of ``nbytes`` whose memory nothing else references."""
        with self._lock:
            best: _Entry | None = None
            for entry in self._entries:
                size = entry.buf.numel()
                if size >= nbytes and (best is None or size < best.buf.numel()) and entry.free():
                    best = entry
            if best is not None:
                self.reused += 1
                return best.buf[:nbytes]
            buf = self._alloc(nbytes)
            if len(self._entries) < self.max_buffers:
                self._entries.append(_Entry(buf))
                self.allocated += 1
            return buf[:nbytes]

    def copy_in(self, value: Any) -> Any:
        """``value`` (a numpy array or a tensor) copied into a pool buffer, as a tensor;
        other values unchanged."""
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.size:
            dtype = _torch_dtype(value.dtype)
            if dtype is None:
                return value
            out = self.take(value.nbytes).view(dtype).view(value.shape)
            np.copyto(out.numpy(), value, casting="no")  # reads the array, writable or not
            return out
        tensor = to_tensor(value)
        if not isinstance(tensor, torch.Tensor) or tensor.is_pinned() or tensor.numel() == 0:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        out = self.take(nbytes).view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out


_TORCH_DTYPES: dict[np.dtype[Any], torch.dtype | None] = {}


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype | None:
    if dtype not in _TORCH_DTYPES:
        try:
            _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except TypeError:  # e.g. a non-native byte order
            _TORCH_DTYPES[dtype] = None
    return _TORCH_DTYPES[dtype]


def _module_for(device: torch.device) -> ModuleType | None:
    module: ModuleType | None = getattr(torch, device.type, None)
    needed = ("Stream", "Event", "current_stream", "stream")
    if module is None or not all(hasattr(module, name) for name in needed):
        return None
    return module


class DeviceMover:
    """Copies batches to ``device`` on a side stream.

    Args:
        device: where batches go.
        backend: the torch module with the device's stream API; default the device's
            own (``torch.cuda`` for ``cuda:0``). None found: copies are synchronous.
    """

    def __init__(self, device: torch.device, backend: ModuleType | None = None) -> None:
        self.device = device
        self.backend = backend if backend is not None else _module_for(device)
        self.side: Any = None
        if self.backend is not None:
            try:
                self.side = self.backend.Stream(device=device)
            except TypeError:  # torch.cpu's stand-in takes no device
                self.side = self.backend.Stream()
        self._retiring: deque[tuple[Any, tuple[Any, ...]]] = deque()

    def issue(self, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        """Start copying ``values``' tensors; returns (device values, event or None)."""
        if self.side is None or self.backend is None:
            return tuple(self._move(v, False) for v in values), None
        with self.backend.stream(self.side):
            moved = tuple(self._move(v, True) for v in values)
            event = self.backend.Event()
            event.record(self.side)
        # The host tensors must outlive the copies that read them.
        self._retiring.append((event, values))
        return moved, event

    def _move(self, value: Any, non_blocking: bool) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=non_blocking)
        return value

    def hand_over(self, moved: tuple[Any, ...], event: Any) -> None:
        """Make the consumer's current stream wait for ``event`` (the host does not)."""
        if event is None or self.backend is None:
            return
        current = self.backend.current_stream(self.device)
        current.wait_event(event)
        if self.device.type != "cpu":
            for value in moved:
                if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                    value.record_stream(current)
        self.retire()

    def retire(self) -> None:
        """Drop the host buffers of copies that have completed."""
        while self._retiring and self._retiring[0][0].query():
            self._retiring.popleft()

    @property
    def in_flight(self) -> int:
        """Copies whose host buffers are still held."""
        return len(self._retiring)
