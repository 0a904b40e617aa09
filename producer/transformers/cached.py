"""Decode once in a Fuel pipeline: a per-example deterministic mapping, cached on disk.

``Mapping(stream, cached_mapping(decode, cache=DiskCache(...)))`` gives what
``Mapping(stream, decode)`` gives, each result read from the cache when there (else
computed, then stored), and the random transformers after it (``RandomFixedSizeCrop``,
a ``Mapping`` drawing from a reseeded ``RandomState``) run on it as before. The chain
keeps its classes and positions, so a served stream's plan, and the seeds of its random
transformers, are those of the uncached pipeline: turning the cache on changes no byte.

A Fuel transformer does not know which example it holds, so an entry is keyed by the
**content** of the mapping's input: a sha256 over its structure, dtypes, shapes and
bytes (:func:`content_digest`). Same input, same stage: same entry, whatever the
stream's order, sharding or dataset (files replaced in place are another input). The
entry (:mod:`producer.cache_entry`) carries the stage's fingerprint and the input's
digest (128 bits of each), checked on read; its index (its record's key) is 60 further bits of the
digest. The storage, cap, measurement and figures are the torch variant's
(:mod:`producer.cache_store`, :mod:`producer.cache_stage`).

Results may be numpy arrays, tuples, lists and str-keyed dicts of them, and plain
scalars (a torch tensor is refused: use ``producer.torch.cached`` for torch datasets).
The mapping must be deterministic and draw nothing: the first few builds check numpy's
and Python's global generators and warn.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from producer import cache_stage
from producer.cache_entry import NUMPY_ONLY
from producer.cache_stage import CacheStats, StageCache, describe
from producer.cache_store import DiskCache, stage_key

__all__ = ["CachedMapping", "cached_mapping", "content_digest", "mapping_fingerprint"]

_DEPTH = 32


def cached_mapping(
    mapping: Callable[[Any], Any],
    cache: DiskCache | str | os.PathLike[str] | None = None,
    *,
    key: str | None = None,
    measure: bool = True,
) -> CachedMapping:
    """``mapping`` with its results cached by its input's content (for ``Mapping``).

    Args:
        mapping: the per-example deterministic stage (decode, resize...): called with
            what ``Mapping`` passes (the example's tuple, or its dict with
            ``mapping_accepts=dict``).
        cache: a :class:`DiskCache`, or a directory for one with its defaults (None:
            :func:`producer.cache_store.default_directory`).
        key: names this stage in its fingerprint instead of the mapping's module,
            qualname and source; it wins over the cache's own ``key``, which names every
            stage that cache serves.
        measure: stop using the cache in a process where a read is not faster than a
            computation (False: always use it).

    Raises:
        ConfigError: ``mapping`` is not callable, ``key`` is not a non-empty str, or its
            fingerprint cannot be derived (a repr naming a memory address: pass
            ``key=``).
    """
    return CachedMapping(mapping, cache, key=key, measure=measure)


class CachedMapping:
    """A mapping whose results are read from a :class:`DiskCache` when there (see
    :func:`cached_mapping`, which makes one).

    Attributes:
        mapping: the wrapped mapping (the cached stage).
        cache: the :class:`DiskCache`.
        fingerprint: the stage's fingerprint (64 hex digits).
        stage: the read-or-build of this process (:class:`producer.cache_stage.StageCache`).
    """

    def __init__(
        self,
        mapping: Callable[[Any], Any],
        cache: DiskCache | str | os.PathLike[str] | None = None,
        *,
        key: str | None = None,
        measure: bool = True,
    ) -> None:
        if not callable(mapping):
            raise ConfigError(f"mapping={mapping!r} is not valid: expected a callable")
        self.mapping = mapping
        self.cache = cache if isinstance(cache, DiskCache) else DiskCache(cache)
        self.fingerprint = mapping_fingerprint(mapping, stage_key(key, self.cache))
        self.stage = StageCache(
            self.cache,
            self.fingerprint,
            getattr(mapping, "__qualname__", type(mapping).__qualname__),
            NUMPY_ONLY,
            measure=measure,
            rng_state=_global_states,
            rng_name="numpy's or Python's global generator",
        )

    def __call__(self, data: Any) -> Any:
        """``mapping(data)``, from the cache when there."""
        if self.stage.bypassed:
            return self.stage.build_only(lambda: self.mapping(data))
        t0 = cache_stage.clock()  # the key is part of a read's cost
        digest = content_digest(data)
        run = self.fingerprint[:32] + digest[:16].hex()
        index = int.from_bytes(digest[16:24], "big") >> 4
        return self.stage.get(index, lambda: self.mapping(data), run, t0)

    @property
    def cache_stats(self) -> CacheStats:
        """This process's figures (:class:`producer.cache_stage.CacheStats`)."""
        return self.stage.cache_stats

    @property
    def stats(self) -> dict[str, Any]:
        """This process's figures, with ``hit_rate``; ``bytes_held`` read from the
        cache's ledger now."""
        return self.stage.stats

    def __repr__(self) -> str:
        return (
            f"cached_mapping({self.mapping!r}, cache={self.cache!r}, "
            f"fingerprint={self.fingerprint[:16]})"
        )


def mapping_fingerprint(mapping: Callable[[Any], Any], key: str | None = None) -> str:
    """The fingerprint of ``mapping`` as a cached stage (64 hex digits): of ``key`` when
    given, else of the mapping (a function or class: module, qualname and a hash of its
    source; a callable object: its class so named, and its repr).

    Raises:
        ConfigError: no ``key`` and a repr names a memory address.
    """
    described: dict[str, Any] = {"kind": "fuel mapping"}
    if key is not None:
        described["key"] = key
    elif callable(mapping) and not isinstance(mapping, type) and hasattr(mapping, "__code__"):
        described["mapping"] = describe(mapping, "mapping")
    else:
        described["class"] = describe(type(mapping), "mapping")
        described["mapping"] = describe(mapping, "mapping")
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def content_digest(value: Any) -> bytes:
    """sha256 of ``value``'s structure and contents (32 bytes): tuples, lists and
    str-keyed dicts (and OrderedDicts) item by item, in order; numpy arrays and scalars
    by dtype, shape and bytes; None/bool/int/float/str/bytes by type and value; every
    part length-prefixed.

    Raises:
        ConfigError: ``value`` holds something else (named with its place).
    """
    h = hashlib.sha256()
    _feed(h, value, "input", 0)
    return h.digest()


def _feed(h: Any, value: Any, where: str, depth: int) -> None:
    if depth > _DEPTH:
        raise ConfigError(f"{where}: the input nests deeper than {_DEPTH} levels")
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.kind in "OV":
            raise ConfigError(f"{where}: cannot key a cache entry on an array of {arr.dtype}")
        _part(h, b"a", f"{arr.dtype.str}{arr.shape}".encode())
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        h.update(struct.pack("<Q", flat.nbytes))
        h.update(flat.data)  # the bytes, not a copy
    elif type(value) is tuple or type(value) is list:
        _part(h, b"t" if type(value) is tuple else b"l", struct.pack("<Q", len(value)))
        for i, v in enumerate(value):
            _feed(h, v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):  # an OrderedDict too: what mapping_accepts=dict passes
        _part(h, b"d", struct.pack("<Q", len(value)))
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where}: dict key {k!r} is not a str")
            _part(h, b"k", k.encode())
            _feed(h, v, f"{where}[{k!r}]", depth + 1)
    elif type(value) is bytes:
        _part(h, b"b", value)
    elif type(value) is str:
        _part(h, b"s", value.encode())
    elif value is None or type(value) in (bool, int, float):
        _part(h, b"v", repr(value).encode())
    else:
        raise ConfigError(
            f"{where}: cannot key a cache entry on a {type(value).__module__}."
            f"{type(value).__qualname__}: a cached mapping's input must be numpy arrays, "
            "tuples, lists and str-keyed dicts of them, and None/bool/int/float/str/bytes"
        )


def _part(h: Any, tag: bytes, payload: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(payload)))
    h.update(payload)


def _global_states() -> bytes:
    """numpy's and Python's global generators' states (a stage must not move them)."""
    state: Any = np.random.get_state()  # ('MT19937', keys, pos, has_gauss, gauss)
    return bytes(state[1].tobytes()) + repr((state[2:], random.getstate())).encode()
