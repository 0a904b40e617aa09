"""Decode once, train many epochs: an exact cache of a dataset's deterministic stage.

``cached(dataset, augment=f, cache=DiskCache(...))`` is a map-style Dataset whose item
``i`` is ``f(dataset[i])``, ``dataset[i]`` read from the cache when it is there (else
built, then stored: :mod:`producer.torch.cache_store`, entries in batchq's frame format:
:mod:`producer.torch.cache_entry`). ``augment`` runs after the cache, in the same process and
at the same point as it would run inside the dataset, so under the per-batch seeds a
producer sets (:mod:`producer.torch.randomness`) its draws are the same whether an example
came from the cache or not: turning the cache on, cold or warm, changes no byte.

The stage must be deterministic (draw nothing, depend only on ``i``): its first result
is what later epochs get. The first few builds check that torch's generator did not
move (a warning names the dataset otherwise).

**The fingerprint** (in every entry; a stage's directory is named by it): the cache's
``key`` when given, else a hash of the dataset's class (module, qualname, and its
source code where Python can read it), its length, and the reprs of its ``root``,
``transform``, ``target_transform``, ``transforms``, ``loader``, and Hugging Face's
``cache_files`` and ``format`` (its ``set_transform``) where it has them, a function as
its module, qualname and source (inside dicts and lists too). A repr that names a memory
address (``<... at 0x...>``) differs per process and is refused, as is a Hugging Face
dataset in memory (no ``cache_files``): pass ``key=``. So a changed transform, root,
size or class never serves stale data; what these do not show (files replaced in place
under the same names, a changed helper the class calls) needs a new ``key``.

**Cache or not, measured.** Each process times its builds and its reads (the first
:data:`READ_BACK` entries it writes are read back at once, so this is known during the
first epoch); once the median of its last :data:`WINDOW` reads is no faster than that of
its last builds (a dataset already in memory), the process stops using the cache
(neither reads nor writes) and logs so once. Medians: on a loaded host a read preempted
for a few milliseconds must not outweigh the others.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from batchq.errors import ConfigError, FrameError
from producer.cache_stats import CacheStats, register
from producer.torch.cache_entry import LeafCodec, decode_entry, encode_entry
from producer.torch.cache_store import DiskCache
from producer.torch.vision import import_torchvision

__all__ = ["CachedDataset", "cached", "stage_fingerprint"]

log = logging.getLogger(__name__)

# Samples of each kind before the cache may be judged (a build and a read).
MIN_SAMPLES = 8
# Entries read back right after they are written, to time a read in the first epoch.
READ_BACK = 8
# The recent samples whose medians are compared (a read preempted on a loaded host must
# not turn the cache off: one such read made a mean of 5 look like a build).
WINDOW = 64
# Items between two judgements.
JUDGE_EVERY = 4
# Builds whose effect on torch's generator is checked.
_RNG_CHECKS = 3
_ATTRIBUTES = (
    "root", "transform", "target_transform", "transforms", "loader", "cache_files", "format",
)  # fmt: skip
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: The clock builds and reads are timed with (seconds; a module global so that a test
#: can judge the cache on a clock of its own).
clock = time.perf_counter


def cached(
    dataset: Any,
    augment: Callable[[Any], Any] | None = None,
    cache: DiskCache | str | os.PathLike[str] | None = None,
    *,
    measure: bool = True,
) -> CachedDataset:
    """``dataset`` with its items cached and ``augment`` applied after the cache.

    Args:
        dataset: a map-style dataset (``__len__``, ``__getitem__``) whose items are the
            deterministic stage's output: numpy arrays, torch tensors (and torchvision's
            ``Image``, ``Mask``, ``Video``), plain tuples, lists and str-keyed dicts of
            them, None, bool, int, float, str, bytes.
        augment: applied to each item after the cache (the random part), or None.
        cache: a :class:`DiskCache`, or a directory for one with its defaults (None:
            :func:`producer.torch.cache_store.default_directory`).
        measure: stop using the cache in a process where a read is not faster than a
            build (False: always use it).

    Raises:
        ConfigError: ``dataset`` has no length, ``augment`` is not callable, or the
            fingerprint cannot be derived (then pass ``DiskCache(key=...)``).
    """
    return CachedDataset(dataset, augment, cache, measure=measure)


class CachedDataset(Dataset[Any]):
    """A torch map-style Dataset: item ``i`` is ``augment(dataset[i])``, ``dataset[i]``
    from the cache when there (see :func:`cached`, which makes one).

    Attributes:
        dataset: the wrapped dataset (the cached stage).
        augment: the random part, or None.
        cache: the :class:`DiskCache`.
        fingerprint: the stage's fingerprint (64 hex digits).
    """

    def __init__(
        self,
        dataset: Any,
        augment: Callable[[Any], Any] | None = None,
        cache: DiskCache | str | os.PathLike[str] | None = None,
        *,
        measure: bool = True,
    ) -> None:
        if augment is not None and not callable(augment):
            raise ConfigError(f"augment={augment!r} is not valid: expected a callable or None")
        self.dataset = dataset
        self.augment = augment
        self.cache = cache if isinstance(cache, DiskCache) else DiskCache(cache)
        self.measure = measure
        self.fingerprint = stage_fingerprint(dataset, self.cache.key)
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self.cache_stats = CacheStats()
        self._rng_checks = _RNG_CHECKS
        self._builds_s: deque[float] = deque(maxlen=WINDOW)
        self._reads_s: deque[float] = deque(maxlen=WINDOW)
        self._events = 0  # items served, to judge every JUDGE_EVERY-th
        register(self)

    # -- the Dataset protocol -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self._stage(index)
        return item if self.augment is None else self.augment(item)

    @property
    def plan_name(self) -> str:
        """The wrapped dataset's class name, which a stream's plan fingerprint uses in
        place of this wrapper's (:attr:`producer.torch.dataset.DatasetStream.plan_fingerprint`):
        with the cache on or off, the shards' seeds are the same."""
        return str(type(self.dataset).__qualname__)

    @property
    def stats(self) -> dict[str, Any]:
        """This process's figures (:class:`producer.cache_stats.CacheStats`, with
        ``hit_rate``); ``bytes_held`` read from the cache's ledger now."""
        if not self.cache_stats.bypassed:
            self.cache_stats.bytes_held = self.cache.bytes_held()  # other processes' too
        return self.cache_stats.as_dict()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()  # another process: its own figures and decision

    def __repr__(self) -> str:
        return (
            f"cached({self.dataset!r}, augment={self.augment!r}, cache={self.cache!r}, "
            f"fingerprint={self.fingerprint[:16]})"
        )

    # -- the cached stage ---------------------------------------------------------------

    def _stage(self, index: int) -> Any:
        s = self.cache_stats
        if s.bypassed:
            s.misses += 1
            return self.dataset[index]
        index = _check_index(index, len(self))
        t0 = clock()
        raw = self.cache.read(self.fingerprint, index)
        if raw is not None:
            try:
                item = decode_entry(raw, self.fingerprint, index, _TENSORS)
            except FrameError as e:
                log.debug("cache entry %d of %s rejected: %s", index, self.fingerprint[:16], e)
                s.rejected += 1
                self.cache.discard(self.fingerprint, index)
                s.bytes_held = self.cache.held_bytes
            else:
                s.hits += 1
                took = clock() - t0
                s.read_s += took
                self._reads_s.append(took)
                s.bytes_held = self.cache.held_bytes
                s.saved_s = s.hits * self._mean_build_s() - s.read_s if s.misses else 0.0
                self._judge()
                return item
        return self._build(index)

    def _build(self, index: int) -> Any:
        s = self.cache_stats
        state = _torch_state() if self._rng_checks else None
        t0 = clock()
        item = self.dataset[index]
        took = clock() - t0
        s.build_s += took
        s.misses += 1
        self._builds_s.append(took)
        if state is not None:
            self._check_rng(state)
        if self.cache.full:
            return item
        payload = encode_entry(item, self.fingerprint, index, _TENSORS)
        if self.cache.write(self.fingerprint, index, payload):
            s.writes += 1
            s.bytes_written += payload.nbytes
            if s.writes <= READ_BACK:  # time a read now: judged within the first epoch
                t1 = clock()
                raw = self.cache.read(self.fingerprint, index)
                if raw is not None:
                    item = decode_entry(raw, self.fingerprint, index, _TENSORS)
                    took = clock() - t1
                    s.read_s += took
                    self._reads_s.append(took)
        s.bytes_held = self.cache.held_bytes
        self._judge()
        return item

    def _mean_build_s(self) -> float:
        s = self.cache_stats
        return s.build_s / s.misses if s.misses else 0.0

    def _judge(self) -> None:
        """Stop using the cache once the median of the recent reads is no faster than
        that of the recent builds."""
        s = self.cache_stats
        self._events += 1
        if not self.measure or self._events % JUDGE_EVERY:  # two medians cost ~10 us
            return
        if min(len(self._builds_s), len(self._reads_s)) < MIN_SAMPLES:
            return
        read_s, build_s = statistics.median(self._reads_s), statistics.median(self._builds_s)
        if read_s >= build_s:
            s.bypassed = True
            log.info(
                "cache of %s (pid %d): a read takes %.3f ms, a build %.3f ms: the cache "
                "does not pay here, the dataset is used directly",
                type(self.dataset).__qualname__,
                os.getpid(),
                read_s * 1e3,
                build_s * 1e3,
            )

    def _check_rng(self, before: Any) -> None:
        self._rng_checks -= 1
        if not _torch_state().equal(before):
            self._rng_checks = 0
            log.warning(
                "the cached stage %s drew from torch's generator while building an item: "
                "it is not deterministic, and its first result is what later epochs get "
                "(move the random part into augment=)",
                type(self.dataset).__qualname__,
            )


def _check_index(index: Any, length: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise ConfigError(f"index {index!r} is not valid: expected an int")
    i = int(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"index {index} out of range for a dataset of {length}")
    return i


def _torch_state() -> Any:
    import torch

    return torch.random.get_rng_state()


# -- tensors in entries -----------------------------------------------------------------


def _tensor_to_array(leaf: Any) -> tuple[str, np.ndarray[Any, Any]] | None:
    import torch

    if not isinstance(leaf, torch.Tensor):
        return None
    tag = _TENSOR_TAGS.get(f"{type(leaf).__module__}.{type(leaf).__qualname__}")
    if tag is None:
        raise ConfigError(
            f"cannot cache a tensor of type {type(leaf).__qualname__}: expected a "
            "torch.Tensor or torchvision's Image, Mask or Video"
        )
    if leaf.dtype == torch.bfloat16:
        raise ConfigError("cannot cache a bfloat16 tensor (numpy has no bfloat16): convert it")
    return tag, leaf.detach().cpu().numpy()


def _from_array(kind: str) -> Callable[[np.ndarray[Any, Any]], Any]:
    def make(arr: np.ndarray[Any, Any]) -> Any:
        import torch

        t = torch.from_numpy(arr)
        if kind == "Tensor":
            return t
        import_torchvision()  # beside a CPU torch, PyPI's wheel needs its help
        from torchvision import tv_tensors

        return t.as_subclass(getattr(tv_tensors, kind))

    return make


_TENSOR_TAGS = {
    "torch.Tensor": "x",
    "torchvision.tv_tensors._image.Image": "xi",
    "torchvision.tv_tensors._mask.Mask": "xm",
    "torchvision.tv_tensors._video.Video": "xv",
}
_TENSORS = LeafCodec(
    to_array=_tensor_to_array,
    from_array={
        "x": _from_array("Tensor"),
        "xi": _from_array("Image"),
        "xm": _from_array("Mask"),
        "xv": _from_array("Video"),
    },
)


# -- the fingerprint --------------------------------------------------------------------


def stage_fingerprint(dataset: Any, key: str | None = None) -> str:
    """The fingerprint of ``dataset`` as a cached stage (64 hex digits; see the module).

    Raises:
        ConfigError: no ``key`` and the dataset has no length, or a repr names a memory
            address.
    """
    try:
        length = len(dataset)
    except TypeError:
        raise ConfigError(
            f"dataset {dataset!r:.80} is not valid for cached(): expected a map-style "
            "dataset with a length"
        ) from None
    described: dict[str, Any] = {"len": length}
    if key is not None:
        described["key"] = key
    else:
        described["class"] = _describe(type(dataset))
        for name in _ATTRIBUTES:
            if hasattr(dataset, name):
                described[name] = _describe(getattr(dataset, name), f"{name} of {dataset!r:.60}")
        if described.get("cache_files") == "[]":  # Hugging Face, in memory: nothing names it
            raise ConfigError(
                f"cannot derive a cache key for {dataset!r:.80}: a dataset in memory (no "
                "cache_files); pass DiskCache(key=...) naming its content"
            )
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _describe(value: Any, where: str = "") -> str:
    if isinstance(value, dict):
        items = ", ".join(f"{k!r}: {_describe(v, where)}" for k, v in value.items())
        return "{" + items + "}"
    if type(value) in (list, tuple):
        return "[" + ", ".join(_describe(v, where) for v in value) + "]"
    if inspect.isclass(value) or inspect.isfunction(value):
        name = f"{value.__module__}.{value.__qualname__}"
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            return name
        return f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    text = repr(value)
    if _ADDRESS.search(text):
        raise ConfigError(
            f"cannot derive a cache key: the {where} has the repr {text!r:.120}, which names "
            "a memory address (it differs per process); pass DiskCache(key=...) naming the stage"
        )
    return text
