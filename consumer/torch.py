"""PyTorch adapter: a ServerDataStream's batches as ``torch.Tensor``s.

Needs the ``torch`` extra (``pip install batchq[torch]``); nothing else in batchq
imports this module.

* CPU tensors are zero-copy and writable: the stream is switched to ``writable``, so
  large frames are received into buffers of their own and each tensor owns its frame's
  memory (small frames are copied once on the reader thread). No buffer is reused: an
  in-place change to one batch never shows in another.
* ``pin_memory=True``: the reader thread copies each batch into pinned memory taken from
  a reused pool (:class:`consumer.torch_memory.PinnedPool`); the training thread never
  pins. Without an accelerator it warns once (at the first epoch, as a DataLoader warns
  when iterated) and delivers unpinned batches.
* ``device='cuda:0'`` (any torch device): the next ``prefetch`` batches are copied with
  ``non_blocking=True`` on a side stream while the loop trains, and the loop's stream
  waits for each copy's event before it gets the batch.
* A ``torch.utils.data.IterableDataset``: ``DataLoader(ts, batch_size=None,
  num_workers=0)`` works (the producers are the workers); ``num_workers > 0`` raises
  :class:`DataLoaderWorkersError` in the main process when the loader's iterator is made
  (``iter(loader)``, the first ``for``), before any worker process starts.
* Accelerate's ``DataLoaderDispatcher`` (what ``accelerator.prepare(DataLoader(ts))``
  makes on several processes: it reads on process 0 only and scatters) raises
  :class:`DataLoaderDispatchError` on every rank when it is iterated, before the first
  step: each rank reads its own share already.
* ``state_dict()`` / ``load_state_dict()`` delegate to the stream, counting only the
  batches the loop has received (not those prefetched): torchdata's
  ``StatefulDataLoader`` checkpoints and resumes through them.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

try:
    import torch
    from torch.utils.data import IterableDataset
except ImportError as e:  # the one place that says how to get the optional extra
    raise ImportError(f"consumer.torch needs PyTorch: pip install 'batchq[torch]' ({e})") from e

from batchq.errors import BatchQueueError, ConfigError
from batchq.protocol.params_log import EMPTY_PARAMS
from batchq.wire.codec import Frame
from consumer.reader.prepare import ArrayAccess
from consumer.stream import ServerDataStream
from consumer.torch_frameworks import (
    DataLoaderDispatchError,
    DataLoaderWorkersError,
    HeapLooks,
    TrainerCheckpoint,
    refuse_dispatcher,
    refuse_loader_workers,
    refuse_shard_wrapper,
    refuse_worker_process,
)
from consumer.torch_memory import DeviceMover, PinnedPool, to_tensor

__all__ = ["DataLoaderDispatchError", "DataLoaderWorkersError", "TorchStream", "TrainerCheckpoint"]


# A batch on its way to the device: its frame (given back by a detach), the device
# values, the copy's event and the params it was built with.
Pending = tuple[Frame, tuple[Any, ...], Any, Mapping[str, Any]]

_NO_ACCELERATOR = (
    "pin_memory=True, but no accelerator is available: batches are delivered in ordinary "
    "(unpinned) memory"
)


def _numpy_dtype(source: str, wanted: Any) -> Any:
    if isinstance(wanted, torch.dtype):
        try:
            return torch.empty((), dtype=wanted).numpy().dtype
        except TypeError:
            raise ConfigError(
                f"dtypes[{source!r}] = {wanted} is not valid: numpy has no such dtype, so "
                "batchq cannot cast to it (cast on the device instead)"
            ) from None
    return wanted


class TorchStream(IterableDataset[Any]):
    """Yields a :class:`ServerDataStream`'s batches as tuples (or dicts) of tensors.

    Args:
        stream: the stream to wrap, not started yet (it is switched to writable).
        as_dict: yield dicts source -> tensor instead of tuples in source order.
        pin_memory: copy batches into pinned host memory on the reader thread (default:
            True when ``device`` is an accelerator).
        device: the device batches are delivered on (``'cuda:0'``...); None or 'cpu':
            CPU tensors.
        prefetch: how many batches are on their way to the device ahead of the loop.
        dtypes: source -> torch or numpy dtype the loop receives (cast on the reader
            thread, with a warning once per source); added to the stream's own.
        pool_buffers: the most pinned buffers the pool keeps.

    Raises:
        ConfigError: the stream has started, the device is not available, or an
            argument is invalid.
    """

    def __init__(
        self,
        stream: ServerDataStream,
        *,
        as_dict: bool = False,
        pin_memory: bool | None = None,
        device: str | torch.device | None = None,
        prefetch: int = 2,
        dtypes: Mapping[str, Any] | None = None,
        pool_buffers: int = 64,
    ) -> None:
        _check_wrappable(stream, prefetch)
        self.stream = stream
        self.as_dict = as_dict
        self.device = _device(device)
        self.prefetch = prefetch
        # Writable frames, each tensor owning its frame's memory (no copy for large
        # frames); a shared-memory batch's segment is its own too, until its tensors are
        # dropped: writable views over it, not the copy a writable=True stream makes.
        stream.configure_frames(
            dtypes={s: _numpy_dtype(s, d) for s, d in (dtypes or {}).items()},
            access=ArrayAccess.VIEWS,
        )
        self.pin_memory = self.device.type != "cpu" if pin_memory is None else bool(pin_memory)
        self.pool: PinnedPool | None = None
        self._warn_unpinned = False
        if self.pin_memory:
            self._pin_batches(pool_buffers)
        self.mover = DeviceMover(self.device) if self.device.type != "cpu" else None
        self._pending: deque[Pending] = deque()  # batches pulled, not yet yielded
        stream.wrapper = self  # its state and close speak for the loop (a later takeover)
        # What Accelerate's GradientState reads of the loader being iterated (_told).
        self.end_of_dataloader = False
        self.remainder = -1  # unknown: gather_for_metrics keeps the last batch whole
        self._params: Mapping[str, Any] = EMPTY_PARAMS  # the params of the batch yielded last
        # The DataLoaders last found holding this stream, and when (a heap scan is
        # O(objects): within LOADER_SCAN_S of one, only those loaders are looked at).
        self._loaders: tuple[float, weakref.WeakSet[Any]] | None = None
        # The reference counts at which a look for a dispatcher (iter) or a shard
        # wrapper (len) found none since a wrapper could last have been made.
        self._dispatch_looks = HeapLooks()
        self._shard_looks = HeapLooks()
        self._generator_asked = False  # Accelerate may have made a shard wrapper since

    # -- what the loop uses ----------------------------------------------------------

    def get_epoch_iterator(self, as_dict: bool | None = None) -> Iterator[Any]:
        """The next epoch's batches, as tensors (starts the epoch at the first batch)."""
        return self._epoch(self.as_dict if as_dict is None else as_dict)

    def __iter__(self) -> Iterator[Any]:
        """One epoch per call (what a DataLoader asks for each epoch)."""
        refuse_worker_process()
        # A dispatcher's inner loader is a DataLoader, whose construction reads
        # __class__ (which forgets the clean counts): at a count where a look found none
        # since, no dispatcher came (a heap scan saved per epoch).
        self._dispatch_looks.look(sys.getrefcount(self), refuse_dispatcher, self)
        return self._epoch(self.as_dict)

    def __len__(self) -> int:
        # Accelerate's IterableDatasetShard asks len() of what it wraps first; it is
        # made where Accelerate asked for a `generator` (below): only then is a scan due.
        if self._generator_asked:
            self._shard_looks.look(sys.getrefcount(self), refuse_shard_wrapper, self)
        return len(self.stream)

    def __getattr__(self, name: str) -> Any:
        # Only for names the object lacks. Accelerate's prepare() asks for a
        # ``generator`` right before it makes an IterableDatasetShard of the stream
        # (dispatch_batches=False), and the shard's iterator asks again before it fails
        # on its batch size (a TypeError of its own).
        if name == "generator":
            self._generator_asked = True
            self._shard_looks.forget()  # a shard wrapper is made next
            refuse_shard_wrapper(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def state_dict(self) -> dict[str, Any]:
        """The stream's :meth:`~ServerDataStream.state_dict`, counting only the batches
        the loop has received (the prefetched ones come again after a resume)."""
        return self.stream.state_dict(held_back=self._held)

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (before the first batch); a rank of a
        data-parallel job may pass every rank's states (see the stream's)."""
        self.stream.load_state_dict(state)

    def set_params(
        self,
        params: Mapping[str, Any],
        *,
        at_batch: int | None = None,
        at_epoch: int | None = None,
    ) -> int:
        """The stream's :meth:`~ServerDataStream.set_params`, at the loop's position (the
        batches prefetched and not yet handed to the loop do not count as handed out).

        Returns:
            The global batch index from which the change applies.
        """
        return self.stream.set_params(
            params, at_batch=at_batch, at_epoch=at_epoch, held_back=self._held
        )

    @property
    def params(self) -> Mapping[str, Any]:
        """The params the batch handed to the loop last was built with."""
        return self._params

    def close(self, finished: bool = False) -> None:
        """Close the stream (see :meth:`ServerDataStream.close`); the batches prefetched
        and not handed to the loop go back with the frames the stream holds, so that a
        trainer resumed from :meth:`state_dict` taken right before reads on at once."""
        held = [frame for frame, *_ in self._pending]
        self._pending.clear()
        self.stream.close(finished, held=held)

    @property
    def _held(self) -> Counter[int]:
        """Shard -> batches pulled from the stream and not yet yielded (the prefetch)."""
        return Counter(frame.shard for frame, *_ in self._pending)

    def __enter__(self) -> TorchStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources, in the order tuples hold them."""
        return self.stream.sources

    @property
    def stats(self) -> dict[str, Any]:
        """The stream's figures."""
        return self.stream.stats

    def __repr__(self) -> str:
        return f"TorchStream({self.stream!r}, device={str(self.device)!r})"

    # A DataLoader with workers is refused where its iterator asks whether this is a
    # datapipe: isinstance reads __class__, before any worker process starts.
    # A DataLoader's construction reads it too (a dispatcher's inner loader is one):
    # the dispatcher look of iter() scans again after it (HeapLooks).
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        looks = self.__dict__.get("_dispatch_looks")
        if looks is not None:
            looks.forget()
        self._loaders = refuse_loader_workers(self, self._loaders)
        return type(self)

    # -- internals ---------------------------------------------------------------------

    def _pin_batches(self, pool_buffers: int) -> None:
        """Have the reader thread copy batches into pinned memory (pin_memory=True)."""
        if torch.accelerator.is_available():
            self.pool = PinnedPool(max_buffers=pool_buffers)
            self.stream.configure_frames(hook=self._pin, hook_keeps_values=True)
        else:
            # Warned at the first epoch, as a DataLoader warns when it is iterated.
            self._warn_unpinned = True

    def _pin(self, frame: Any) -> Any:
        """Reader-thread hook: the batch's arrays copied into pinned pool buffers.

        The frame keeps numpy arrays (views of the pinned tensors, which they keep
        alive, so the pool sees the buffer in use): a hook that keeps the values gives
        the stream values it can encode again, as a detach does with the frames held.
        """
        pool = self.pool
        if pool is None:
            return frame
        return _replace_data(frame, tuple(_as_array(pool.copy_in(v)) for v in frame.data))

    def _epoch(self, as_dict: bool) -> Iterator[Any]:
        if self._warn_unpinned:
            self._warn_unpinned = False
            warnings.warn(_NO_ACCELERATOR, UserWarning, stacklevel=3)
        frames = self.stream.open_epoch()
        self._pending.clear()
        mover = self.mover
        gradients = _gradient_state()
        if gradients is not None:
            yield from self._told(gradients, frames, mover, as_dict)
        elif mover is None:
            for frame in frames:
                self._params = self.stream.params  # the stream's last: this frame's
                yield _shape(frame.sources, tuple(to_tensor(v) for v in frame.data), as_dict)
        else:
            yield from self._moved(frames, mover, as_dict)

    def _told(
        self, gradients: Any, frames: Iterator[Any], mover: DeviceMover | None, as_dict: bool
    ) -> Iterator[Any]:
        """The epoch, with Accelerate's GradientState told which batch is its last, as its
        own loaders tell it: ``accumulate()`` syncs there and starts counting again, and
        ``gather_for_metrics`` and the transformers Trainer's metrics see the end. Before,
        accumulation ran across epochs and the run's last batches never reached a step.
        To know a batch is the last, the next one is pulled before it is handed over (one
        batch ahead, held as a prefetched one is: a state saved meanwhile does not count
        it, a close() gives it back)."""
        self.end_of_dataloader = False
        gradients._add_dataloader(self)
        try:
            if mover is None:
                yield from self._ahead(frames, as_dict)
            else:
                yield from self._moved(frames, mover, as_dict, ahead=True)
        finally:
            gradients._remove_dataloader(self)

    def _ahead(self, frames: Iterator[Any], as_dict: bool) -> Iterator[Any]:
        """On the CPU: each batch handed over once the next is pulled (or the epoch ended:
        ``end_of_dataloader``); an error of the next is raised after the batch."""
        pending, deferred = self._pending, None
        while True:
            if not pending:  # the first, or a close() gave the one ahead back: it raises
                frame = next(frames, None)
                if frame is None:
                    return
                pending.append((frame, (), None, self.stream.params))
            frame, _, _, self._params = pending.popleft()
            try:
                following = next(frames, None)
            except BatchQueueError as e:
                following, deferred = None, e
            if following is not None:
                pending.append((following, (), None, self.stream.params))
            elif deferred is None:
                self.end_of_dataloader = True
            yield _shape(frame.sources, tuple(to_tensor(v) for v in frame.data), as_dict)
            if deferred is not None:
                raise deferred

    def _moved(
        self, frames: Iterator[Any], mover: DeviceMover, as_dict: bool, ahead: bool = False
    ) -> Iterator[Any]:
        """The epoch's batches on the device, up to ``prefetch`` of them on their way.

        The batches on their way stay kept (``_pending``, counted by ``_held``) when
        the loop breaks out and this generator closes: a state saved then does not count
        them, and a close() gives them back; the next epoch's start drops them.
        """
        pending = self._pending
        deferred: BaseException | None = None
        while True:
            if not pending:
                if deferred is not None:
                    raise deferred
                if not self._pull(frames, mover, pending):
                    return
            if deferred is None:
                deferred = self._top_up(frames, mover, pending)
            frame, moved, event, self._params = pending.popleft()
            if ahead and not pending and deferred is None:  # is this the epoch's last?
                try:
                    if not self._pull(frames, mover, pending):
                        self.end_of_dataloader = True
                except BatchQueueError as e:
                    deferred = e
            mover.hand_over(moved, event)
            try:
                yield _shape(frame.sources, moved, as_dict)
            except GeneratorExit:
                # The loop broke out: a close() needs the frames only, not their copies
                # on the device (nor their host values, which the mover holds until
                # each copy has ended).
                for i, (held, _, _, params) in enumerate(pending):
                    pending[i] = (held, (), None, params)
                raise

    def _top_up(
        self,
        frames: Iterator[Any],
        mover: DeviceMover,
        pending: deque[Pending],
    ) -> BatchQueueError | None:
        """Top up without waiting: only batches that have arrived already. Returns the
        error a later batch raised, to be raised after the batches before it."""
        while len(pending) < self.prefetch and self.stream.frame_ready():
            try:
                if not self._pull(frames, mover, pending):
                    return None
            except BatchQueueError as e:
                return e
        return None

    def _pull(
        self,
        frames: Iterator[Any],
        mover: DeviceMover,
        pending: deque[Pending],
    ) -> bool:
        frame = next(frames, None)
        if frame is None:
            return False
        moved, event = mover.issue(tuple(to_tensor(v) for v in frame.data))
        pending.append((frame, moved, event, self.stream.params))
        return True


def _gradient_state() -> Any:
    """Accelerate's GradientState (shared by every Accelerator of the process), where
    accelerate is imported; None elsewhere (accelerate is never imported here)."""
    module = sys.modules.get("accelerate.state")
    state_class = getattr(module, "GradientState", None)
    return state_class() if state_class is not None else None


def _check_wrappable(stream: Any, prefetch: Any) -> None:
    """Refuse what is not a ServerDataStream before its first epoch, or a bad prefetch."""
    if not isinstance(stream, ServerDataStream):
        raise ConfigError(f"stream {stream!r} is not valid: expected a ServerDataStream")
    if stream.started:
        raise ConfigError("wrap the ServerDataStream before its first epoch")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ConfigError(f"prefetch {prefetch!r} is not valid: expected an integer >= 1")


def _device(device: str | torch.device | None) -> torch.device:
    """The torch device batches are delivered on (default the CPU), checked available."""
    out = torch.device(device) if device is not None else torch.device("cpu")
    if out.type != "cpu":
        _check_device(out)
    return out


def _shape(sources: tuple[str, ...], values: tuple[Any, ...], as_dict: bool) -> Any:
    return dict(zip(sources, values, strict=True)) if as_dict else values


def _replace_data(frame: Any, data: tuple[Any, ...]) -> Any:
    return dataclasses.replace(frame, data=data)


def _as_array(value: Any) -> Any:
    # A CPU tensor's numpy view shares its memory and holds the tensor (its base).
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _check_device(device: torch.device) -> None:
    module: ModuleType | None = getattr(torch, device.type, None)
    if device.type == "mps":  # its availability lives in torch.backends
        module = torch.backends.mps
    available = getattr(module, "is_available", None)
    if module is None or not callable(available) or not available():
        raise ConfigError(
            f"device {str(device)!r} is not valid here: torch.{device.type} is not available "
            "on this machine"
        )
    count = getattr(module, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ConfigError(
            f"device {str(device)!r} is not valid here: this machine has {count()} "
            f"{device.type} device(s)"
        )
