"""A cache's figures, and the process's caches summed for the producer's counters.

Every cached stage (:func:`producer.torch.cache.cached`,
:func:`producer.transformers.cached_mapping`: their
:class:`producer.cache_stage.StageCache`) keeps a :class:`CacheStats` of what happened in
this process and registers itself here; the producer's heartbeat writes
:func:`process_totals` into its pstats counters
(:class:`batchq.protocol.fields.ProducerStat`'s ``cache_*``), which ``status``, the
exporter and ``report`` read, and the trainer's ``stream.stats`` sums.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["CacheStats", "StatsSource", "process_totals", "register"]


@dataclass
class CacheStats:
    """What one cached stage did in this process.

    Attributes:
        hits: examples read from the cache.
        misses: examples built (absent, rejected, or the cache not used).
        rejected: entries found torn, corrupted or foreign, built again.
        writes: entries this process stored.
        bytes_written: their bytes.
        bytes_held: the cache directory's bytes (every stage's, every process's), as of
            this process's last look at the ledger (its first use, a write, a hit).
        build_s: time spent building the misses.
        read_s: time spent reading and decoding the hits.
        saved_s: build time saved: hits x the mean build time, less the reads' time.
        bypassed: the cache did not pay in this process and is no longer used.
    """

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    writes: int = 0
    bytes_written: int = 0
    bytes_held: int = 0
    build_s: float = 0.0
    read_s: float = 0.0
    saved_s: float = 0.0
    bypassed: bool = False

    @property
    def hit_rate(self) -> float | None:
        """hits / (hits + misses), None before any example."""
        total = self.hits + self.misses
        return self.hits / total if total else None

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain values (with ``hit_rate``)."""
        out: dict[str, Any] = dict(self.__dict__)
        out["hit_rate"] = self.hit_rate
        return out


class StatsSource(Protocol):
    """Anything with a :class:`CacheStats` (a cached dataset)."""

    @property
    def cache_stats(self) -> CacheStats: ...


_sources: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def register(source: StatsSource) -> None:
    """Count ``source``'s figures in :func:`process_totals` while it lives."""
    with _lock:
        _sources.add(source)


def process_totals() -> CacheStats | None:
    """The figures of every cached stage alive in this process, summed; None if none."""
    with _lock:
        stats = [s.cache_stats for s in list(_sources)]
    if not stats:
        return None
    out = CacheStats()
    for s in stats:
        out.hits += s.hits
        out.misses += s.misses
        out.rejected += s.rejected
        out.writes += s.writes
        out.bytes_written += s.bytes_written
        out.bytes_held = max(out.bytes_held, s.bytes_held)  # one directory, mostly
        out.build_s += s.build_s
        out.read_s += s.read_s
        out.saved_s += s.saved_s
        out.bypassed = out.bypassed or s.bypassed
    return out
