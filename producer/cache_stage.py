"""A cached stage in one process: read an entry or build it, decide from measurement, and
count what happened.

What :func:`producer.torch.cached` (a torch Dataset) and a Fuel ``Mapping(...,
cache=...)`` (:mod:`producer.transformers.cached`) share, without torch: a
:class:`StageCache` reads an example's entry (:mod:`producer.cache_entry`) from a
:class:`~producer.cache_store.DiskCache`, or builds the example and stores it; a torn,
corrupted or foreign entry is discarded and built again, never served.

**Cache or not, measured.** Each process times its builds and its reads (the first
:data:`READ_BACK` entries it writes are read back at once, so this is known during the
first epoch); once the median of its last :data:`WINDOW` reads is no faster than that of
its last builds (a stage already in memory), the process stops using the cache (neither
reads nor writes) and logs so once. Medians: on a loaded host a read preempted for a few
milliseconds must not outweigh the others.

**The stage draws nothing.** The first few builds compare a generator's state (torch's
for a Dataset, numpy's global one for a Fuel mapping) before and after, and warn: a
stage that draws would leave the generators elsewhere on a miss than on a hit.

**Its figures.** Every stage keeps a :class:`CacheStats` of what happened in this
process and registers itself; the producer's heartbeat writes :func:`process_totals`
(every stage alive in the process, summed) into its pstats counters
(:class:`batchq.protocol.fields.ProducerStat`'s ``cache_*``), which ``status``, the
exporter and ``report`` read, and the trainer's ``stream.stats`` sums.

:func:`describe` names a stage's parts (functions and classes by module, qualname and a
hash of their source; other values by their repr, refused when it names a memory
address) for the fingerprints.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from batchq.errors import ConfigError, FrameError
from batchq.wire.frame import Pieces
from producer.cache_entry import NUMPY_ONLY, LeafCodec, decode_entry, encode_entry
from producer.cache_store import DiskCache

__all__ = [
    "JUDGE_EVERY",
    "MIN_SAMPLES",
    "READ_BACK",
    "WINDOW",
    "CacheStats",
    "StageCache",
    "StatsSource",
    "describe",
    "process_totals",
    "register",
]

log = logging.getLogger(__name__)

#: An index a batch holds again (get_many reads it back once the batch is stored).
_AGAIN = object()
#: Samples of each kind before the cache may be judged (a build and a read).
MIN_SAMPLES = 8
#: Entries read back right after they are written, to time a read in the first epoch.
READ_BACK = 8
#: The recent samples whose medians are compared (a read preempted on a loaded host must
#: not turn the cache off: one such read made a mean of 5 look like a build).
WINDOW = 64
#: Items between two judgements (two medians cost ~10 us).
JUDGE_EVERY = 4
# Builds whose effect on the generator is checked.
_RNG_CHECKS = 3
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: The clock builds and reads are timed with (seconds; a module global so that a test
#: can judge the cache on a clock of its own).
clock = time.perf_counter


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


class StageCache:
    """One stage's entries in a :class:`DiskCache`, read or built, in one process.

    Args:
        cache: where the entries live.
        fingerprint: the stage's fingerprint (hex; its first 32 digits name its
            directory).
        name: the stage as the log names it.
        leaves: how leaves other than numpy arrays are stored (torch's tensors).
        measure: stop using the cache where a read is not faster than a build.
        rng_state: the state of the generator the stage must not draw from, as bytes
            (None: not checked).
        rng_name: that generator, as the warning names it.

    Attributes:
        cache_stats: this process's figures (registered for the heartbeat).
    """

    def __init__(
        self,
        cache: DiskCache,
        fingerprint: str,
        name: str,
        leaves: LeafCodec = NUMPY_ONLY,
        *,
        measure: bool = True,
        rng_state: Callable[[], bytes] | None = None,
        rng_name: str = "",
    ) -> None:
        self.cache = cache
        self.fingerprint = fingerprint
        self.name = name
        self.leaves = leaves
        self.measure = measure
        self.rng_state = rng_state
        self.rng_name = rng_name
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self.cache_stats = CacheStats()
        self._rng_checks = _RNG_CHECKS if self.rng_state is not None else 0
        self._builds_s: deque[float] = deque(maxlen=WINDOW)
        self._reads_s: deque[float] = deque(maxlen=WINDOW)
        self._events = 0  # items served, to judge every JUDGE_EVERY-th
        self._verified = False  # the first entry read checked against a build (_verify)
        register(self)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()  # another process: its own figures and decision

    @property
    def stats(self) -> dict[str, Any]:
        """This process's figures (:class:`CacheStats`, with
        ``hit_rate``); ``bytes_held`` read from the cache's ledger now (every process's
        entries)."""
        if not self.cache_stats.bypassed:
            self.cache_stats.bytes_held = self.cache.bytes_held()
        return self.cache_stats.as_dict()

    @property
    def bypassed(self) -> bool:
        """The cache did not pay in this process: the stage is used directly."""
        return self.cache_stats.bypassed

    def build_only(self, build: Callable[[], Any]) -> Any:
        """``build()``, counted as a miss (the cache bypassed)."""
        self.cache_stats.misses += 1
        return build()

    def get_many(
        self, indices: Sequence[int], build: Callable[[int], Any], then: Callable[[Any], Any]
    ) -> list[Any]:
        """``[then(get(i, lambda: build(i))) for i in indices]`` (a batch: torch's
        ``__getitems__``), the entries built stored together once the batch's items are
        made (:meth:`DiskCache.write_many`: one reservation, write and index append).
        ``then`` (the augmentation) runs after that store, item by item in order: one
        that changes an item in place cannot reach an entry's bytes before they are
        written, and it draws what it did (a stage draws nothing). An index the batch
        holds again is read back from its entry (built again where it was not stored)."""
        pending: list[tuple[int, Pieces, str]] = []
        items: list[Any] = []
        seen: set[int] = set()
        try:
            for i in indices:
                items.append(
                    _AGAIN if i in seen else self.get(i, partial(build, i), pending=pending)
                )
                seen.add(i)
        finally:  # what was built is stored, even where a later item raised
            self._store(pending)
        for n, i in enumerate(indices):
            if items[n] is _AGAIN:
                items[n] = self.get(i, partial(build, i))
        return [then(item) for item in items]

    def get(
        self,
        index: int,
        build: Callable[[], Any],
        run: str | None = None,
        t0: float | None = None,
        pending: list[tuple[int, Pieces, str]] | None = None,
    ) -> Any:
        """The example entry ``index`` holds, else ``build()``'s (then stored).

        Args:
            index: the entry's index (its index record's key, the frame's ``k``).
            build: makes the example.
            run: the entry's own fingerprint, checked on read (default: the stage's;
                a content-keyed entry adds its key's digest).
            t0: when the read began on :data:`clock` (a key computed first is part of
                the read's time); default now.
            pending: where a built entry waits to be stored with others (default:
                stored at once).
        """
        if self.bypassed:
            return self.build_only(build)
        s = self.cache_stats
        run = run or self.fingerprint
        t0 = clock() if t0 is None else t0
        raw = self.cache.read(self.fingerprint, index)
        if raw is not None:
            try:
                item = decode_entry(raw, run, index, self.leaves)
            except FrameError as e:
                log.debug("cache entry %d of %s rejected: %s", index, self.fingerprint[:16], e)
                s.rejected += 1
                self.cache.discard(self.fingerprint, index)
                s.bytes_held = self.cache.held_bytes
            else:
                took = clock() - t0
                if not self._verified:
                    same, fresh = self._verify(index, raw, build, run)
                    if not same:  # another stage's entry: the cache is off here
                        s.misses += 1
                        return fresh
                s.hits += 1
                s.read_s += took
                self._reads_s.append(took)
                s.bytes_held = self.cache.held_bytes
                s.saved_s = s.hits * self._mean_build_s() - s.read_s if self._builds_s else 0.0
                self._judge()
                return item
        return self._build(index, build, run, pending)

    def _verify(
        self, index: int, raw: bytearray, build: Callable[[], Any], run: str
    ) -> tuple[bool, Any]:
        """Whether the first entry this process reads (``raw``, as stored) is what a
        build makes now, encoded the same way byte for byte; and that build. A
        fingerprint cannot see everything that makes a stage (a subset's own rows under
        the same length, a parameter a transform's repr leaves out): an entry of another
        stage under the same fingerprint, where it differs at the index read, is caught
        here, and then this process stops using the cache, saying so, rather than serve
        it. One entry, not a proof: two stages alike at that index pass. Checked again
        at the next hit until a comparison is made (a build that raised, another thread's
        first hit meanwhile: each compares its own). The build is timed as any (a warm
        process's saving needs a build's time); one that draws from the generator is the
        stage's known fault (its first result stands: ``_warn_drew`` says so)."""
        state = self.rng_state() if self._rng_checks and self.rng_state else None
        t0 = clock()
        fresh = build()
        self._builds_s.append(clock() - t0)
        self._verified = True  # a comparison is made (after the build: it may raise)
        if state is not None and self.rng_state is not None and self.rng_state() != state:
            self._warn_drew()
            return True, fresh
        if bytes(raw) == bytes(encode_entry(fresh, run, index, self.leaves)):
            return True, fresh
        self.cache_stats.bypassed = True
        log.warning(
            "cache of %s (pid %d): entry %d differs from the item built now: another "
            "stage's entries are under this fingerprint (a subset of the same length, a "
            "transform whose repr hides a parameter...), or the stage is not "
            "deterministic; the cache is not used here (pass key=... naming this stage)",
            self.name,
            os.getpid(),
            index,
        )
        return False, fresh

    def _build(
        self,
        index: int,
        build: Callable[[], Any],
        run: str,
        pending: list[tuple[int, Pieces, str]] | None,
    ) -> Any:
        s = self.cache_stats
        state = self.rng_state() if self._rng_checks and self.rng_state else None
        t0 = clock()
        item = build()
        took = clock() - t0
        s.build_s += took
        s.misses += 1
        self._builds_s.append(took)
        if state is not None:
            self._check_rng(state)
        if not self.cache.full:
            entry = (index, encode_entry(item, run, index, self.leaves), run)
            if pending is None:
                self._store([entry])
            else:
                pending.append(entry)
        self._judge()
        return item

    def _store(self, entries: list[tuple[int, Pieces, str]]) -> None:
        """Write built entries (index, payload, fingerprint) together, counted; the first
        :data:`READ_BACK` this process writes are read back, timed: the cache is judged
        within the first epoch."""
        s = self.cache_stats
        if not entries or self.cache.full:
            return
        written = self.cache.write_many(self.fingerprint, [(i, p) for i, p, _ in entries])
        for index, payload, run in entries[:written]:
            s.writes += 1
            s.bytes_written += payload.nbytes
            if s.writes <= READ_BACK:
                t1 = clock()
                raw = self.cache.read(self.fingerprint, index)
                if raw is not None:
                    decode_entry(raw, run, index, self.leaves)
                    took = clock() - t1
                    s.read_s += took
                    self._reads_s.append(took)
        s.bytes_held = self.cache.held_bytes

    def _mean_build_s(self) -> float:
        s = self.cache_stats
        if s.misses:
            return s.build_s / s.misses
        return statistics.fmean(self._builds_s) if self._builds_s else 0.0  # a warm start

    def _judge(self) -> None:
        """Stop using the cache once the median of the recent reads is no faster than
        that of the recent builds."""
        self._events += 1
        if not self.measure or self._events % JUDGE_EVERY:
            return
        if min(len(self._builds_s), len(self._reads_s)) < MIN_SAMPLES:
            return
        read_s, build_s = statistics.median(self._reads_s), statistics.median(self._builds_s)
        if read_s >= build_s:
            self.cache_stats.bypassed = True
            log.info(
                "cache of %s (pid %d): a read takes %.3f ms, a build %.3f ms: the cache "
                "does not pay here, the stage is used directly",
                self.name,
                os.getpid(),
                read_s * 1e3,
                build_s * 1e3,
            )

    def _check_rng(self, before: bytes) -> None:
        self._rng_checks -= 1
        if self.rng_state is not None and self.rng_state() != before:
            self._warn_drew()

    def _warn_drew(self) -> None:
        """Say that the stage drew from the generator while building (once: no check
        is made after)."""
        self._rng_checks = 0
        log.warning(
            "the cached stage %s drew from %s while building an item: it is not "
            "deterministic, and its first result is what later epochs get (move the "
            "random part after the cache)",
            self.name,
            self.rng_name,
        )


def _bound(function: Any) -> str:
    """The values a function holds besides its source: its defaults and its closure's
    cells (``brighten(2)`` and ``brighten(3)`` are two stages), each described (a
    function among them by its name and source only: no recursion), or by its type
    where it cannot be (a repr naming an address or raising, a value holding itself:
    the first read's check, ``_verify``, catches what that leaves alike)."""
    held = [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).items()]
    for cell in function.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet (a name the function assigns later)
            continue
    if not held:
        return ""
    out = []
    for value in held:
        if inspect.isfunction(value):
            out.append(_named(value))
            continue
        try:
            out.append(describe(value))
        except Exception:  # an address, a repr that raised, a value that holds itself
            out.append(type(value).__qualname__)
    return "(" + ", ".join(out) + ")"


def _named(value: Any) -> str:
    """A function or class as its module, qualname and a hash of its source."""
    name = f"{value.__module__}.{value.__qualname__}"
    try:
        source = inspect.getsource(value)
    except (OSError, TypeError):
        return name
    return f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def describe(value: Any, where: str = "") -> str:
    """``value`` as a stage's fingerprint names it: dicts, lists and tuples item by item,
    a function or class as its module, qualname and a hash of its source, anything else
    as its repr.

    Raises:
        ConfigError: a repr names a memory address (it differs per process).
    """
    if isinstance(value, dict):
        items = ", ".join(f"{k!r}: {describe(v, where)}" for k, v in value.items())
        return "{" + items + "}"
    if type(value) in (list, tuple):
        return "[" + ", ".join(describe(v, where) for v in value) + "]"
    if type(value) in (set, frozenset):  # sorted: a set's order differs per process
        return "{" + ", ".join(sorted(describe(v, where) for v in value)) + "}"
    if inspect.isclass(value) or inspect.isfunction(value):
        return _named(value) + (_bound(value) if inspect.isfunction(value) else "")
    text = repr(value)
    if _ADDRESS.search(text):
        raise ConfigError(
            f"cannot derive a cache key: the {where} has the repr {text!r:.120}, which names "
            "a memory address (it differs per process); pass key=... to cached() or "
            "cached_mapping(), naming the stage"
        )
    return text
