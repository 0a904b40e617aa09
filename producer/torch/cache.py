"""Decode once, train many epochs: an exact cache of a dataset's deterministic stage.

``cached(dataset, augment=f, cache=DiskCache(...))`` is a map-style Dataset whose item
``i`` is ``f(dataset[i])``, ``dataset[i]`` read from the cache when it is there (else
built, then stored: :mod:`producer.cache_store`, entries in batchq's frame format:
:mod:`producer.cache_entry`). ``augment`` runs after the cache, in the same process and
at the same point as it would run inside the dataset, so under the per-batch seeds a
producer sets (:mod:`producer.torch.randomness`) its draws are the same whether an example
came from the cache or not: turning the cache on, cold or warm, changes no byte.

The stage must be deterministic (draw nothing, depend only on ``i``): its first result
is what later epochs get. The first few builds check that torch's generator did not
move (a warning names the dataset otherwise).

**The fingerprint** (in every entry; a stage's directory is named by it): the stage's
``key`` when given (``cached(..., key=)``, else the cache's), else a hash of the
dataset's class (module, qualname, and its source code where Python can read it), its
length, and the reprs of its ``root``, ``transform``, ``target_transform``,
``transforms``, ``loader``, and Hugging Face's ``cache_files`` and ``format`` (its
``set_transform``) where it has them, a function as its module, qualname and source
with its defaults and closure values (inside dicts and lists too), a ``Subset``'s
dataset and indices, a ``ConcatDataset``'s datasets. A repr that names a memory address
(``<... at 0x...>``) differs per process and is refused, as is a Hugging Face dataset in
memory (no ``cache_files``): pass ``key=``. What these do not show (a parameter a repr
leaves out, files replaced in place under the same names, a changed helper the class
calls) is caught where the first entry a process reads differs from a build
(:meth:`producer.cache_stage.StageCache.get`: that process then builds every item);
beyond that, it needs a new ``key``.

**Cache or not, measured** (:mod:`producer.cache_stage`, shared with the Fuel variant):
each process stops using a cache whose reads are no faster than its builds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from batchq.errors import ConfigError
from producer.cache_entry import LeafCodec
from producer.cache_stage import CacheStats, StageCache, describe
from producer.cache_store import DiskCache, stage_key
from producer.torch.vision import import_torchvision

__all__ = ["CachedDataset", "cached", "stage_fingerprint"]

_ATTRIBUTES = (
    "root", "transform", "target_transform", "transforms", "loader", "cache_files", "format",
)  # fmt: skip


def cached(
    dataset: Any,
    augment: Callable[[Any], Any] | None = None,
    cache: DiskCache | str | os.PathLike[str] | None = None,
    *,
    key: str | None = None,
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
            :func:`producer.cache_store.default_directory`).
        key: names this stage in its fingerprint instead of what is derived from the
            dataset (its class, length and reprs); it wins over the cache's own ``key``,
            which names every stage that cache serves.
        measure: stop using the cache in a process where a read is not faster than a
            build (False: always use it).

    Raises:
        ConfigError: ``dataset`` has no length, ``augment`` is not callable, ``key`` is
            not a non-empty str, or the fingerprint cannot be derived (then pass
            ``key=``).
    """
    return CachedDataset(dataset, augment, cache, key=key, measure=measure)


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
        key: str | None = None,
        measure: bool = True,
    ) -> None:
        if augment is not None and not callable(augment):
            raise ConfigError(f"augment={augment!r} is not valid: expected a callable or None")
        self.dataset = dataset
        self.augment = augment
        self.cache = cache if isinstance(cache, DiskCache) else DiskCache(cache)
        self.measure = measure
        self.fingerprint = stage_fingerprint(dataset, stage_key(key, self.cache))
        self.stage = StageCache(
            self.cache,
            self.fingerprint,
            type(dataset).__qualname__,
            _TENSORS,
            measure=measure,
            rng_state=_torch_state,
            rng_name="torch's generator",
        )

    @property
    def cache_stats(self) -> CacheStats:
        """This process's figures (:class:`producer.cache_stage.CacheStats`)."""
        return self.stage.cache_stats

    # -- the Dataset protocol -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if self.stage.bypassed:
            item = self.stage.build_only(lambda: self.dataset[index])
        else:
            i = _check_index(index, len(self))
            item = self.stage.get(i, lambda: self.dataset[i])
        return item if self.augment is None else self.augment(item)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """``[self[i] for i in indices]`` (how a DataLoader and a producer read a batch),
        the entries it builds stored together (one write for the batch)."""
        if self.stage.bypassed:
            return [self[i] for i in indices]
        checked = [_check_index(i, len(self)) for i in indices]
        augment = self.augment if self.augment is not None else _same
        return self.stage.get_many(checked, self.dataset.__getitem__, augment)

    @property
    def plan_name(self) -> str:
        """The wrapped dataset's class name, which a stream's plan fingerprint uses in
        place of this wrapper's (:attr:`producer.torch.dataset.DatasetStream.plan_fingerprint`):
        with the cache on or off, the shards' seeds are the same."""
        return str(type(self.dataset).__qualname__)

    @property
    def stats(self) -> dict[str, Any]:
        """This process's figures (:class:`producer.cache_stage.CacheStats`, with
        ``hit_rate``); ``bytes_held`` read from the cache's ledger now."""
        return self.stage.stats

    def __repr__(self) -> str:
        return (
            f"cached({self.dataset!r}, augment={self.augment!r}, cache={self.cache!r}, "
            f"fingerprint={self.fingerprint[:16]})"
        )


def _same(item: Any) -> Any:
    return item


def _check_index(index: Any, length: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise ConfigError(f"index {index!r} is not valid: expected an int")
    i = int(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"index {index} out of range for a dataset of {length}")
    return i


def _torch_state() -> bytes:
    import torch

    return bytes(torch.random.get_rng_state().numpy().tobytes())


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
    # A plain view first: a tv_tensor's every method goes through torchvision's
    # __torch_function__ in Python (3 calls: 10-25 us of an entry's encoding).
    return tag, leaf.as_subclass(torch.Tensor).detach().cpu().numpy()


def _from_array(kind: str, arr: np.ndarray[Any, Any]) -> Any:
    import torch

    t = torch.from_numpy(arr)
    if kind == "Tensor":
        return t
    import_torchvision()  # beside a CPU torch, PyPI's wheel needs its help
    from torchvision import tv_tensors

    return t.as_subclass(getattr(tv_tensors, kind))


_TENSOR_TAGS = {
    "torch.Tensor": "x",
    "torchvision.tv_tensors._image.Image": "xi",
    "torchvision.tv_tensors._mask.Mask": "xm",
    "torchvision.tv_tensors._video.Video": "xv",
}
_TENSORS = LeafCodec(
    to_array=_tensor_to_array,
    from_array={
        # partial, not closures: a DataLoader's spawned workers get the dataset pickled
        "x": functools.partial(_from_array, "Tensor"),
        "xi": functools.partial(_from_array, "Image"),
        "xm": functools.partial(_from_array, "Mask"),
        "xv": functools.partial(_from_array, "Video"),
    },
)


# -- the fingerprint --------------------------------------------------------------------


def _parts(dataset: Any) -> dict[str, Any]:
    """What a dataset made of others names them by: torch's ``Subset`` (and wrappers
    like it) its ``dataset``'s fingerprint and a digest of its ``indices`` (the two
    halves of a ``random_split`` are two stages), ``ConcatDataset`` each of its
    ``datasets``'."""
    out: dict[str, Any] = {}
    inner = getattr(dataset, "dataset", None)
    if inner is not None and inner is not dataset and hasattr(inner, "__getitem__"):
        out["dataset"] = _parts_name(inner)
    indices = getattr(dataset, "indices", None)
    if isinstance(indices, range):  # by its ends, not its (maybe billions of) items
        out["indices"] = f"range({indices.start}, {indices.stop}, {indices.step})"
    elif indices is not None and not isinstance(indices, str | bytes):
        try:
            flat = np.asarray(indices)
        except Exception:  # not an array's: named by its type
            flat = None
        out["indices"] = (
            hashlib.sha256(f"{flat.dtype.str}{flat.shape}".encode() + flat.tobytes()).hexdigest()
            if flat is not None and flat.dtype.kind in "biufUS"
            else describe(type(indices))
        )
    parts = getattr(dataset, "datasets", None)
    if isinstance(parts, list | tuple):
        out["datasets"] = [_parts_name(part) for part in parts]
    return out


def _parts_name(part: Any) -> str:
    """A part's fingerprint, or its type where it cannot be named (no length, a repr
    with an address): a new refusal would fail stages named before; the first read's
    check (``StageCache._verify``) stays."""
    try:
        return stage_fingerprint(part)
    except Exception:  # no length, an address, a part that holds the whole...
        return describe(type(part))


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
        described["class"] = describe(type(dataset))
        for name in _ATTRIBUTES:
            if hasattr(dataset, name):
                described[name] = describe(getattr(dataset, name), f"{name} of {dataset!r:.60}")
        described |= _parts(dataset)
        if described.get("cache_files") == "[]":  # Hugging Face, in memory: nothing names it
            raise ConfigError(
                f"cannot derive a cache key for {dataset!r:.80}: a dataset in memory (no "
                "cache_files); pass cached(..., key=...) naming its content"
            )
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
