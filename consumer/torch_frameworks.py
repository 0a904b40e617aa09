"""The stream inside DataLoaders and training frameworks: what would lose or repeat data
is refused, and the transformers Trainer's checkpoints hold the stream's state.

* DataLoader workers are refused before any worker process starts. The producers are
  the workers and a queue has one trainer: a DataLoader with ``num_workers > 0`` would
  make each worker process a second trainer. The loaders that hold a stream are found
  through the garbage collector's referrers (never by walking the caller's frames),
  when the loader's iterator reads the dataset's ``__class__``.
* Accelerate's ``DataLoaderDispatcher`` (it reads on rank 0 only) is refused on every
  rank before the first step, and so is its ``IterableDatasetShard``
  (``dispatch_batches=False``: it would keep every R-th batch of a rank's share).
* :class:`TrainerCheckpoint`: a callback of the transformers Trainer that keeps the
  stream's state in every checkpoint and resumes the stream from it (the Trainer's skip
  of the trained batches passes the stream by, and the Trainer counts them).
"""

from __future__ import annotations

import functools
import gc
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from batchq.errors import ConfigError

__all__ = [
    "LOADER_SCAN_S",
    "TRAINER_STATE_KEY",
    "DataLoaderDispatchError",
    "DataLoaderWorkersError",
    "HeapLooks",
    "TrainerCheckpoint",
    "refuse_dispatcher",
    "refuse_loader_workers",
    "refuse_shard_wrapper",
    "refuse_worker_process",
]


# After a scan of the heap for DataLoaders holding a stream, how long only the loaders it
# found are looked at again (a loader's iterator asks several times in a row).
LOADER_SCAN_S = 1.0


class DataLoaderWorkersError(ConfigError):
    """A DataLoader with ``num_workers > 0`` around a TorchStream: the producers are the
    workers, and a queue has one trainer (a worker process would be a second one)."""


class DataLoaderDispatchError(ConfigError):
    """Accelerate's ``DataLoaderDispatcher`` around a TorchStream: it iterates the stream
    on process 0 only and scatters what it read, so every other rank's share of every
    epoch would never be read (a silent loss of about (R - 1) / R of the data). Raised
    too for its ``IterableDatasetShard`` (``dispatch_batches=False``), which would keep
    every R-th batch of what each rank reads, its own share already."""


_DISPATCH_ERROR = (
    "accelerator.prepare() wrapped a DataLoader around a TorchStream in Accelerate's "
    "DataLoaderDispatcher, which reads on process 0 only and scatters: every other rank's "
    "share would never be read. Each rank reads its own share already (its rank is found "
    "from torch.distributed): pass the stream itself to accelerator.prepare() (it is "
    "returned as it is) or iterate DataLoader(stream, batch_size=None) without preparing "
    "it; with the transformers Trainer, override get_train_dataloader() to return the "
    "stream"
)


def _accelerate_class(name: str) -> type | None:
    """A class of Accelerate's ``accelerate.data_loader`` (its DataLoaderDispatcher, its
    IterableDatasetShard), where a wrapper of it can exist: accelerate is never imported
    here, and a process that has not imported it has none."""
    found = getattr(sys.modules.get("accelerate.data_loader"), name, None)
    return found if isinstance(found, type) else None


def _dispatched(loader: object, dispatcher: type) -> bool:
    """Whether a ``dispatcher`` (Accelerate's DataLoaderDispatcher) wraps ``loader`` (its
    ``base_dataloader``)."""
    return any(
        _holder_of(holder, loader, dispatcher, "base_dataloader") is not None
        for holder in gc.get_referrers(loader)
    )


def _workers_error(num_workers: int) -> DataLoaderWorkersError:
    return DataLoaderWorkersError(
        f"DataLoader(num_workers={num_workers}) around a TorchStream: use num_workers=0. "
        "batchq's producers are the workers (start more with `batchq serve --workers N`); "
        "a DataLoader worker process would be a second trainer on the queue"
    )


def refuse_loader_workers(
    dataset: object, known: tuple[float, weakref.WeakSet[Any]] | None
) -> tuple[float, weakref.WeakSet[Any]]:
    """Raise if a DataLoader with workers holds ``dataset``; return the loaders found.

    Its iterator's base class checks ``isinstance(self._dataset, IterDataPipe)`` (in
    torch's DataLoader and torchdata's StatefulDataLoader alike) before the multi-process
    iterator starts a single worker, and isinstance reads ``__class__``: the error comes
    from there, at ``iter(loader)``. The loaders holding the dataset are found among the
    objects that refer to it (the garbage collector's public view of the heap), not by
    looking at the caller's frames. A scan costs time in proportion to the heap (15-30 ms
    for 200k objects), and a loader's construction and iteration ask several times: for
    LOADER_SCAN_S after a scan only the loaders it found are looked at again. (A loader
    made and iterated within that time is refused in its worker instead, at its first
    batch: :func:`refuse_worker_process`.)
    """
    now = time.monotonic()
    if known is None or now - known[0] >= LOADER_SCAN_S:
        found = (_loader_of(holder, dataset) for holder in gc.get_referrers(dataset))
        known = (now, weakref.WeakSet(loader for loader in found if loader is not None))
    loaders = known[1]
    for loader in list(loaders):
        # Only a loader being iterated: its own constructor's isinstance checks come
        # before it sets persistent_workers (its last public attribute).
        if loader.num_workers > 0 and _constructed(loader):
            for it in gc.get_referrers(dataset):
                _mark_shut(it, dataset)
            raise _workers_error(loader.num_workers)
    return known


_SHARD_ERROR = (
    "accelerator.prepare() with dispatch_batches=False wrapped a TorchStream in "
    "Accelerate's IterableDatasetShard, which needs a batch size and keeps every R-th "
    "batch of what it reads: each rank's stream yields that rank's share already, so the "
    "rest of it would be dropped. Pass the stream itself to accelerator.prepare() (it is "
    "returned as it is) or iterate DataLoader(stream, batch_size=None) without preparing it"
)


class HeapLooks:
    """When a look through the heap's referrers for a wrapper of a stream (a scan: 40-80
    ms in the transformers Trainer's heap) can be skipped: at a reference count of the
    stream where one found nothing, and no wrapper was made since.

    A count alone proves nothing: ``loader = prepare(loader)`` swaps one reference for
    another. What does make a wrapper is a DataLoader's construction (Accelerate's
    dispatcher is one, around a DataLoader of the stream), and that reads the stream's
    ``__class__`` (its isinstance questions): the stream's hook calls :meth:`forget`
    there. Between two such reads the counts seen clean are kept (up to
    :attr:`MAX_COUNTS`: call sites differ in their temporaries, and a framework asking
    len() or iter() from several would otherwise scan at every call). A scan that raised,
    or did not look (accelerate not imported yet), is not kept.
    """

    #: The most counts kept (then forgotten all at once: at worst one scan more each).
    MAX_COUNTS = 16

    def __init__(self) -> None:
        self._clean: set[int] = set()

    def look(self, refs: int, scan: Callable[[object], bool], dataset: object) -> None:
        """``scan(dataset)`` unless one at ``refs`` references found nothing since the
        last :meth:`forget`; ``scan`` returns whether it looked."""
        if refs in self._clean:
            return
        if not scan(dataset):
            return
        if len(self._clean) >= self.MAX_COUNTS:
            self._clean.clear()
        self._clean.add(refs)

    def forget(self) -> None:
        """A wrapper may have been made since: the next look scans."""
        self._clean.clear()


def refuse_dispatcher(dataset: object) -> bool:
    """Raise if Accelerate's DataLoaderDispatcher wraps a DataLoader holding ``dataset``.

    Called where a loader's iterator asks the dataset for its own (``iter(dataset)``,
    once per epoch): every rank makes the dispatcher's inner iterator, before rank 0
    reads and broadcasts the first batch, so every rank raises before the first step.
    Only where accelerate was imported (without it there is no dispatcher); two scans
    of the heap's referrers, once per epoch. Returns whether it looked.
    """
    dispatcher = _accelerate_class("DataLoaderDispatcher")
    if dispatcher is None:
        return False
    for holder in gc.get_referrers(dataset):
        loader = _loader_of(holder, dataset)
        if loader is not None and _dispatched(loader, dispatcher):
            raise DataLoaderDispatchError(_DISPATCH_ERROR)
    return True


def refuse_shard_wrapper(dataset: object) -> bool:
    """Raise if Accelerate's ``IterableDatasetShard`` holds ``dataset``.

    Called where that wrapper asks the dataset first, before its batch size fails with a
    TypeError of its own: ``len()``, and its iterator's look for a ``generator``
    attribute. Only where accelerate was imported; one scan of the heap's referrers.
    Returns whether it looked.
    """
    shard_type = _accelerate_class("IterableDatasetShard")
    if shard_type is None:
        return False
    for holder in gc.get_referrers(dataset):
        if _holder_of(holder, dataset, shard_type) is not None:
            raise DataLoaderDispatchError(_SHARD_ERROR)
    return True


def _mark_shut(holder: Any, dataset: object) -> None:
    """Mark the half-built iterator (it holds the dataset as ``_dataset``) shut.

    Its ``__del__`` reads ``_shutdown``, which our error comes before: without it the
    user sees a second traceback ("Exception ignored in __del__") after ours. The one
    private attribute of torch's this module writes (tests/consumer/test_torch.py fails
    if torch renames it).
    """
    attrs = getattr(holder, "__dict__", None)
    if isinstance(attrs, dict) and attrs.get("_dataset") is dataset and "_shutdown" not in attrs:
        attrs["_shutdown"] = True


def _constructed(loader: DataLoader[Any]) -> bool:
    return "persistent_workers" in vars(loader)


def _loader_of(holder: Any, dataset: object) -> DataLoader[Any] | None:
    """The DataLoader that ``holder`` is (or whose attribute dict it is), if it holds
    ``dataset``."""
    loader: DataLoader[Any] | None = _holder_of(holder, dataset, DataLoader)
    return loader


def _holder_of(holder: Any, held: object, kind: type, attr: str = "dataset") -> Any:
    """The ``kind`` object that ``holder`` is (or whose attribute dict it is), if it
    holds ``held`` as its ``attr`` (an object's attributes are its own referrer or its
    dict's, depending on whether Python materialised the dict); else None."""
    if isinstance(holder, kind):
        return holder if vars(holder).get(attr) is held else None
    if not isinstance(holder, dict) or holder.get(attr) is not held:
        return None
    for owner in gc.get_referrers(holder):
        if isinstance(owner, kind) and vars(owner) is holder:
            return owner
    return None


def refuse_worker_process() -> None:
    # The last line of defence (a DataLoader copy this module does not know).
    info = torch.utils.data.get_worker_info()
    if info is not None:
        raise _workers_error(info.num_workers)


#: Where a checkpoint's ``trainer_state.json`` keeps the stream's state (its
#: ``stateful_callbacks``, which the Trainer writes from rank 0 and every rank reads back
#: on resume). Not a callback class's name: the Trainer's own restore of callbacks
#: (``restore_callback_states_from_checkpoint``) then leaves it alone.
TRAINER_STATE_KEY = "batchq"

#: The TrainerCheckpoints of this process (as long as their Trainers keep them): the
#: Trainer's skip of a resumed epoch's trained batches passes their streams by, and the
#: loaders that hold one as ``dataset``.
_CHECKPOINTS: weakref.WeakSet[TrainerCheckpoint] = weakref.WeakSet()

#: The attribute of our ``skip_first_batches`` that holds the one it stands in for.
_HOOKED = "_batchq_stands_in_for"

_SKIP_ERROR = (
    "TrainerCheckpoint: the Trainer resumes with ignore_data_skip=True, so it would count "
    "the resumed epoch's batches from its first one again, not from the checkpoint's: "
    "with gradient_accumulation_steps > 1 the epoch's last optimizer step would never "
    "come and its batches would go into the next epoch's first step. Leave "
    "TrainingArguments(ignore_data_skip=False): the stream resumes at the checkpoint's "
    "batch itself and the Trainer's skip passes it by. Pass the callback to the Trainer "
    "when it is made (Trainer(..., callbacks=[TrainerCheckpoint(stream)])): it sets "
    "ignore_data_skip=False then"
)

_NO_HOOK_ERROR = (
    "TrainerCheckpoint: the Trainer resumes with ignore_data_skip=False, so it would skip "
    "the batches the stream's own state resumes past, a second time (this transformers' "
    "Trainer has no skip_first_batches in transformers.trainer that batchq could pass the "
    "stream by). Pass the callback to the Trainer when it is made "
    "(Trainer(..., callbacks=[TrainerCheckpoint(stream)]): it sets ignore_data_skip then), "
    "or set TrainingArguments(ignore_data_skip=True)"
)

_NO_HOOK_WARNING = (
    "TrainerCheckpoint: this transformers' Trainer has no skip_first_batches in "
    "transformers.trainer, so it resumes with ignore_data_skip=True and counts a resumed "
    "epoch's batches from 0: with gradient_accumulation_steps > 1 a resume from a "
    "checkpoint taken mid-epoch merges that epoch's last optimizer step into the next "
    "epoch's first (the batches are exact)"
)


def _resumes_itself(loader: object) -> bool:
    """Whether ``loader`` is a stream that a TrainerCheckpoint resumes, or holds one as
    its ``dataset`` (a DataLoader of it)."""
    streams = [checkpoint.stream for checkpoint in list(_CHECKPOINTS)]
    held = (loader, getattr(loader, "dataset", None))
    return any(one is stream for one in held if one is not None for stream in streams)


def _hook_trainer_skip() -> bool:
    """Make the transformers Trainer's skip of a resumed epoch's trained batches pass
    the streams that resume themselves by; whether it is in place.

    A resume from a checkpoint taken mid-epoch has the Trainer call its module's
    ``skip_first_batches(train_dataloader, n)`` (Accelerate's): the stream is at the
    checkpoint's batch already, so the loader comes back as it is, and the Trainer
    counts the epoch's steps, its optimizer steps and ``state.epoch`` as in the run that
    was not stopped. Any other loader goes to the function it stands in for. False where
    ``transformers.trainer`` is not imported or has no such function.
    """
    module = sys.modules.get("transformers.trainer")
    skip = getattr(module, "skip_first_batches", None)
    if not callable(skip):
        return False
    if getattr(skip, _HOOKED, None) is None:
        original: Callable[..., Any] = skip

        @functools.wraps(original)
        def skip_first_batches(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
            if _resumes_itself(dataloader):
                return dataloader
            return original(dataloader, *args, **kwargs)

        setattr(skip_first_batches, _HOOKED, original)
        module.skip_first_batches = skip_first_batches  # type: ignore[union-attr]
    return True


class TrainerCheckpoint:
    """A transformers ``TrainerCallback`` that keeps the stream's state in the Trainer's
    checkpoints and resumes the stream from them: ``train(resume_from_checkpoint=...)``
    then reads on exactly where the checkpoint was taken, on every rank, and makes the
    optimizer steps (their batches, ``global_step``, ``state.epoch``) of the run that
    was not stopped.

    ``Trainer(..., callbacks=[TrainerCheckpoint(stream)])``. At each step or epoch end
    where the Trainer saves (or evaluates, which may save the best model), the stream's
    ``state_dict()`` goes into the Trainer's state (``stateful_callbacks['batchq']``),
    which the checkpoint's ``trainer_state.json`` holds; a resumed ``train()`` loads it
    into the stream before the first batch (rank 0's state stands for every rank where
    the stream says ``every_rank``; any other raises naming why). The stream resumes
    itself, and the Trainer resumes its own count of the epoch's batches: its skip of
    the trained batches (``transformers.trainer.skip_first_batches``) returns a stream
    of a TrainerCheckpoint, or a DataLoader of one, as it is. The callback sets
    ``args.ignore_data_skip = False`` when the Trainer is made (with it the Trainer would
    count the resumed epoch from its first batch, and with gradient accumulation miss
    its last optimizer step); a resume with ``ignore_data_skip=True`` raises
    :class:`~batchq.errors.ConfigError` before the first step. transformers is not
    imported here: the Trainer calls a callback's ``on_*`` methods by name, and the
    events this one does not use do nothing.

    Args:
        stream: what the Trainer trains from (a TorchStream, or anything with
            ``state_dict()`` and ``load_state_dict()``), before its first batch.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # the Trainer's other events
            return _ignore
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _resume_by_stream(self) -> bool:
        """The stream resumes itself and the Trainer's skip passes it by; whether that
        skip is in place (else the Trainer must not skip at all: ignore_data_skip)."""
        _CHECKPOINTS.add(self)
        return _hook_trainer_skip()

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer is made: the stream skips what was trained, the Trainer counts it."""
        hooked = self._resume_by_stream()
        args.ignore_data_skip = not hooked
        if not hooked and getattr(args, "gradient_accumulation_steps", 1) > 1:
            warnings.warn(_NO_HOOK_WARNING, UserWarning, stacklevel=2)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Resuming (the Trainer loaded a checkpoint's state): resume the stream too."""
        hooked = self._resume_by_stream()
        saved = (state.stateful_callbacks or {}).get(TRAINER_STATE_KEY)
        if state.global_step <= 0 or not isinstance(saved, dict):
            return
        if hooked and args.ignore_data_skip:
            raise ConfigError(_SKIP_ERROR)
        if not hooked and not args.ignore_data_skip:
            raise ConfigError(_NO_HOOK_ERROR)
        attributes = saved.get("attributes")
        if not isinstance(attributes, dict) or not isinstance(attributes.get("state"), dict):
            raise ConfigError(
                f"trainer_state.json's stateful_callbacks[{TRAINER_STATE_KEY!r}] = "
                f"{saved!r:.200}: expected {{'args': {{}}, 'attributes': {{'state': "
                "<the stream's state_dict()>}} as TrainerCheckpoint writes it"
            )
        self.stream.load_state_dict(attributes["state"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Keep the stream's state where this step's end may save a checkpoint."""
        self._keep(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Keep the stream's state where this epoch's end may save a checkpoint."""
        self._keep(state, control)

    def _keep(self, state: Any, control: Any) -> None:
        # Before the save: the Trainer writes its state (with stateful_callbacks) in
        # _save_checkpoint, after these events and before on_save.
        if control.should_save or control.should_evaluate:
            callbacks = state.stateful_callbacks
            if callbacks is None:
                callbacks = state.stateful_callbacks = {}
            callbacks[TRAINER_STATE_KEY] = {
                "args": {},
                "attributes": {"state": self.stream.state_dict()},
            }


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
