"""Every Redis key name batchq uses, built in one place.

Layout of queue ``Q`` (every key carries the hash tag ``{Q}`` so that one queue lives in
one Redis Cluster slot and a Lua script may touch all of it)::

    bq:{Q}:meta         HASH    protocol version, run id, fingerprint, hwm, shards per
                                epoch (S), window (W), next shard to mint, the trainer's
                                floor, the trainer's claim (token, deadline, fence),
                                finished flag, batches per epoch, the trainer's
                                shared-memory host identity (``shm_host``, see
                                :mod:`batchq.wire.shm`), the pipeline's axis labels (JSON
                                source -> axis names, set by producers), the run's
                                stripes (batchq/protocol/stripes.py)
    bq:{Q}:data         LIST    frames (or references to frames): producers push left,
                                the trainer pops right; LLEN is the queue's depth
    bq:{Q}:wake         LIST    wake-up tokens for producers blocked at the hwm or at the
                                look-ahead window, and for trainers waiting for the plan
    bq:{Q}:planwait     SET     ``len()`` callers waiting for the plan before any claim
                                (a token each); the join that publishes the plan wakes
                                one per member and deletes the set
    bq:{Q}:work         LIST    shards handed back (by a stopped or dead producer) to be
                                leased again before any fresh shard; fresh shards are
                                minted in plan order from meta ``next``
    bq:{Q}:lease:<p>    LIST    the shards producer p holds, as ``<g>:<run>:<token>``
                                (the run they were granted in: a reap in another run
                                drops them)
    bq:{Q}:producers    ZSET    producer id -> heartbeat deadline (server ms)
    bq:{Q}:clients      HASH    '<p>' and '<p>:hb' -> CLIENT ID of producer p's main and
                                heartbeat connections (all closed: p was killed)
    bq:{Q}:ledger       HASH    reserved: what the trainer has received (resume)
    bq:{Q}:incarnation  STRING  set when the queue is created; its absence means Redis
                                lost the queue's state
    bq:{Q}:stats        HASH    counters for monitoring, updated inside the scripts
    bq:{Q}:dead         LIST    frames that failed validation, with their reason (capped)
    bq:{Q}:failures     HASH    global shard -> failed attempts (raised, timed out, died)
    bq:{Q}:pstats       HASH    per producer: '<p>:batches', ':bytes', ':produce_ms',
                                ':blocked_ms' (updated by the push script)
    bq:{Q}:trainer      HASH    the trainer's recent figures (stall fractions, rates,
                                epoch progress), written by the pop script about once a
                                second
    bq:{Q}:history      LIST    one JSON sample a second from the trainer (depth, rates,
                                stall), newest first, capped at an hour
    bq:{Q}:scale        STRING  the autoscalers' decision lease: the id of the
                                ``serve --workers auto`` that may change its pool now
                                (SET NX PX; held until the workers it started joined)
    bq:{Q}:scalers      ZSET    autoscaler id -> heartbeat deadline (server ms): how
                                many hosts share the deficit
    bq:{Q}:scalelog     LIST    the autoscalers' decisions as JSON, newest first (capped)
    bq:{Q}:frame:<run>:<p>:<n>
                        STRING  a large frame stored by reference for a run (the data
                                list holds its name); no TTL once it is in the data list
    bq:{Q}:data:<r>     LIST    rank r's data list, when a data-parallel trainer of
                                world > 1 reads the run (batchq/protocol/ranks.py); meta then
                                holds world, even and per-rank fields '<name>:<r>'
                                (claim, claim_deadline, claimed, claim_client, done,
                                next, floor)
    bq:{Q}:counts       HASH    '<epoch>:<r>' -> rank r's batches in hand ('<n>') or final
                                count ('=<n>') of an epoch, where shards hold several
                                batches; 'n:<epoch>:<r>:<j>' -> the batches of rank r's
                                local shard j, where the plan cannot count them
                                (consumer/balance.py)
    bq:{Q}:remap        HASH    slot -> shard for the epoch in meta ``remap_epoch``: a job
                                resumed with another number of ranks re-splits the
                                rest of that epoch (consumer/rank_state.py)
    bq:{Q}:params       STRING  the run's change log of producer parameters (JSON, run
                                id and entries: batchq.protocol.params_log), written by
                                params.lua only; meta ``params`` is its stamp
    bq:{Q}:quarantine   HASH    the run's examples its dataset could not read, replaced by
                                substitutes (``on_sample_error='quarantine'``,
                                producer/quarantine.py): 'run', 'count' (examples met),
                                'kept' (records), 'i:<index>' -> the record (JSON,
                                :func:`batchq.protocol.layout.quarantine_record`), at most
                                :data:`batchq.protocol.layout.QUARANTINE_CAP` records;
                                written by quarantine.lua only
    bq:{Q}:trainer:<r>  HASH    rank r's recent figures (as ``trainer``)
    bq:{Q}:history:<r>  LIST    rank r's samples (as ``history``)
    bq:{Q}:groups       HASH    a run read by several groups (:mod:`batchq.protocol.groups`):
                                group name ('' the default group) -> its slot; meta
                                ``groups`` says how many slots the run has
    bq:{Q}:refs         HASH    frame key -> the groups that still have to read it: a
                                frame stored once by reference for several groups (no
                                field: one reader); the last reader's release deletes it
    bq:{Q}:data@<i>     LIST    group slot i's data list (``data@<i>:<r>`` its rank r's);
                                slot 0 keeps the plain names. So do ``stats@<i>`` (HASH,
                                the group's counters), ``trainer@<i>``, ``history@<i>``,
                                ``ledger@<i>``, ``counts@<i>``, ``remap@<i>`` (its
                                elastic resume's), ``wake@<i>`` (its pops'
                                wake-ups: a producer blocked at its full list waits
                                there), and the meta fields ``<name>@<i>`` /
                                ``<name>@<i>:<r>`` (claim, next, floor...)

What a finished run leaves are its records, which ``batchq status`` and ``report`` read
afterwards: ``meta``, ``incarnation``, ``pstats``, each group slot's ``stats``,
``trainer`` and ``history`` (per rank), ``groups`` where several groups read it, and
``dead``, ``params``, ``quarantine``, ``scale``/``scalers``/``scalelog`` where it wrote
them. Its lists
(work, data, wake, per group slot too), counts, failures, remap, refs and frames go
when its last reader finishes (claim.lua), and a producer's lease list when
it is reaped or joins again (each entry names its run, so none reaches another run).

The type column is :data:`KEY_TYPES` (by the key's name in :class:`QueueKeys`): push.lua
and pop.lua check theirs before writing (tests/batchq/protocol/test_fields.py compares
their tables with it), and a trainer names the expected type in ``WrongKeyType``.

The fields of the meta, stats and trainer hashes are named in :mod:`batchq.protocol.fields`, the
formats of entries and values in :mod:`batchq.protocol.layout`.

Only the data list's name contains "data"; producer ids and queue names may not contain
the characters that would break that (see :func:`check_name`).

A striped queue (:mod:`batchq.protocol.stripes`) is several queues: stripe 0 is ``Q``
itself, stripe k >= 1 the queue ``<Q>--s<k>.<i>`` (:func:`stripe_name`), whose hash tag
puts it in a slot of its own, in the middle of the k-th N-th of the cluster's slot space
after the one holding ``Q``'s: on a cluster of N masters owning equal ranges of slots
(what ``redis-cli --cluster create`` makes), N stripes land on N masters. Names
ending in ``--s<k>.<i>`` are reserved for stripes: ``batchq status`` lists them under
their queue (:func:`queue_from_meta_key` skips them).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Final, TypeVar

from batchq.client.cluster import SLOTS, key_slot
from batchq.errors import ConfigError

__all__ = [
    "KEY_TYPES",
    "PREFIX",
    "SLOT_KEYS",
    "STRIPE_CANDIDATES",
    "QueueKeys",
    "check_name",
    "is_stripe",
    "queue_from_meta_key",
    "slot_suffix",
    "stripe_name",
]

PREFIX = "bq"

#: The Redis type batchq keeps under each key, by its name in :class:`QueueKeys` (a
#: per-rank key has the type of the queue-wide one: ``data:<r>`` is a list); ``lease``
#: is a producer's lease list, ``frame`` a frame stored by reference.
KEY_TYPES: Final[Mapping[str, str]] = {
    "meta": "hash", "data": "list", "wake": "list", "work": "list", "lease": "list",
    "producers": "zset", "clients": "hash", "ledger": "hash", "incarnation": "string",
    "stats": "hash", "dead": "list", "failures": "hash", "pstats": "hash",
    "trainer": "hash", "history": "list", "scale": "string", "scalers": "zset",
    "scalelog": "list", "frame": "string", "counts": "hash", "remap": "hash",
    "groups": "hash", "refs": "hash",
    "params": "string", "quarantine": "hash", "planwait": "set",
}  # fmt: skip

#: The keys a group slot has of its own (slot i >= 1: ``<name>@<i>``), see
#: :meth:`QueueKeys.slot_view`.
SLOT_KEYS: Final = ("data", "stats", "trainer", "history", "ledger", "counts", "remap", "wake")


def slot_suffix(slot: int) -> str:
    """What group slot ``slot``'s keys and meta fields add to their names: ``''`` for
    slot 0, else ``'@<slot>'``."""
    return "" if slot == 0 else f"@{slot}"


# Queue names and producer ids become parts of key names: keep them to a safe alphabet,
# without braces (they would move the hash tag) or colons (they separate fields).
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_META_RE = re.compile(r"^bq:\{([A-Za-z0-9_.\-]{1,128})\}:meta$")


def check_name(value: str, what: str) -> str:
    """Validate a queue name or producer id.

    Args:
        value: the name to check.
        what: what the name is, for the error message ("queue", "producer id").

    Returns:
        The name, unchanged.

    Raises:
        ConfigError: the name is empty, too long or has characters outside
            ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{what} {value!r} is not valid: expected 1-128 characters from [A-Za-z0-9_.-]"
        )
    return value


def queue_from_meta_key(key: str | bytes) -> str | None:
    """Return the queue name of a ``bq:{Q}:meta`` key, or None for any other key (and
    for a stripe's: it is listed with its queue)."""
    text = key.decode() if isinstance(key, bytes) else key
    match = _META_RE.match(text)
    return match.group(1) if match and not is_stripe(match.group(1)) else None


_STRIPE_RE = re.compile(r"--s[0-9]+\.[0-9]+$")
#: How many names a stripe's is chosen among (the one whose slot is nearest its target).
STRIPE_CANDIDATES = 1024


def is_stripe(name: str) -> bool:
    """Whether ``name`` is a stripe's (``<Q>--s<k>.<i>``)."""
    return _STRIPE_RE.search(name) is not None


@functools.lru_cache(maxsize=1024)
def stripe_name(queue: str, stripe: int, count: int) -> str:
    """The queue name of stripe ``stripe`` of a queue striped ``count`` ways: ``queue``
    itself for stripe 0, else ``<queue>--s<stripe>.<i>`` for the ``i`` below
    :data:`STRIPE_CANDIDATES` whose cluster slot is nearest the middle of the
    ``stripe``-th ``1/count`` of the slot space after the one holding ``queue``'s slot
    (the first such ``i``). A pure function of its arguments: every producer and
    trainer names the same stripes.

    Raises:
        ConfigError: the name would be longer than a queue name may be.
    """
    if stripe == 0:
        return queue
    base = f"{queue}--s{stripe}."
    if len(base) + len(str(STRIPE_CANDIDATES - 1)) > 128:
        raise ConfigError(
            f"queue {queue!r} is too long to be striped: expected at most "
            f"{128 - len(base) + len(queue) - len(str(STRIPE_CANDIDATES - 1))} characters"
        )
    # The middle of the count-th of the slot space ``stripe`` after the one holding the
    # queue's slot: with equal ranges per master (count of them), a master each.
    first = key_slot(f"{{{queue}}}") * count // SLOTS
    target = (2 * ((first + stripe) % count) + 1) * SLOTS // (2 * count)

    def distance(i: int) -> int:
        gap = abs(key_slot(f"{{{base}{i}}}") - target)
        return min(gap, SLOTS - gap)

    return f"{base}{min(range(STRIPE_CANDIDATES), key=distance)}"


K = TypeVar("K")
V = TypeVar("V")

# A process that lives for weeks meets many producer ids (restarts, autoscaling): past
# this many names a derived-key map starts again rather than grow.
_DERIVED_CAP = 4096


class _Derived(dict[K, V]):
    """Names derived from an argument, built on first use and then read as a mapping:
    the scripts' wrappers read them on every call without a call into this module."""

    def __init__(self, build: Callable[[K], V]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, key: K) -> V:
        if len(self) >= _DERIVED_CAP:
            self.clear()
        value = self[key] = self._build(key)
        return value


class QueueKeys:
    """The key names of one queue.

    Args:
        queue: the queue's name (validated with :func:`check_name`).
    """

    META_PATTERN = f"{PREFIX}:{{*}}:meta"

    def __init__(self, queue: str) -> None:
        self.queue = check_name(queue, "queue")
        self.base = f"{PREFIX}:{{{queue}}}"
        self.meta = f"{self.base}:meta"
        self.data = f"{self.base}:data"
        self.wake = f"{self.base}:wake"
        self.planwait = f"{self.base}:planwait"  # len() waiting for the plan, unclaimed
        self.work = f"{self.base}:work"
        self.producers = f"{self.base}:producers"
        self.clients = f"{self.base}:clients"  # producer -> CLIENT ID of its connections
        self.ledger = f"{self.base}:ledger"
        self.incarnation = f"{self.base}:incarnation"
        self.stats = f"{self.base}:stats"
        # The queue's own counters, in a group slot's view too (not a SLOT_KEYS name):
        # what the recovery scripts count (redone_shards...), whichever group calls them.
        self.queue_stats = self.stats
        self.dead = f"{self.base}:dead"
        self.failures = f"{self.base}:failures"
        self.pstats = f"{self.base}:pstats"
        self.trainer = f"{self.base}:trainer"
        self.history = f"{self.base}:history"
        self.scale = f"{self.base}:scale"
        self.scalers = f"{self.base}:scalers"
        self.scalelog = f"{self.base}:scalelog"
        self.frame_prefix = f"{self.base}:frame:"
        self.counts = f"{self.base}:counts"  # data-parallel ranks' counts per epoch
        self.remap = f"{self.base}:remap"  # an elastic resume's epoch: slot -> shard
        self.groups = f"{self.base}:groups"  # group name -> slot (several groups)
        self.refs = f"{self.base}:refs"  # frame key -> groups yet to read it
        self.slot = 0  # the group slot whose keys data, stats, trainer... name (slot_view)
        self.params = f"{self.base}:params"  # the run's change log of producer parameters
        self.quarantine = f"{self.base}:quarantine"  # examples replaced by substitutes
        #: producer id -> its lease list (as :meth:`lease`), read as a mapping.
        self.leases: Mapping[str, str] = _Derived(self._lease)
        # The KEYS tails of the scripts, for a run of one group or several
        # (batchq.protocol.groups), read as mappings too:
        #: group slot -> the keys as that slot reads the run (:meth:`slot_view`).
        self.slots: Mapping[int, QueueKeys] = _Derived(self.slot_view)
        #: (group slots, worlds) -> lease.lua's KEYS tail: every slot's ledger, then every
        #: slot's data lists (slot 0's ranks first; worlds: each slot's ranks, or one
        #: number for every slot), then every slot's remap hash (a run of one group:
        #: where its world > 1); 0 group slots: a run of one group, slot 0's.
        self.lease_tails: Mapping[tuple[int, int | tuple[int, ...]], list[str]] = _Derived(
            self._lease_tail
        )
        #: (target mask, rank, world) -> push.lua's KEYS tail: each target slot's data
        #: list (of that rank) and stats hash, ascending.
        self.push_tails: Mapping[tuple[int, int, int], list[str]] = _Derived(self._push_tail)
        #: (group slots, world) -> claim.lua's and resume.lua's KEYS tail: the keys of
        #: slots 0..max(groups, 1) (:meth:`slot_keys`, each slot's in a row).
        self.slot_tails: Mapping[tuple[int, int], list[str]] = _Derived(self._slot_tail)

    def types(self, *names: str) -> dict[str, str]:
        """Key -> the Redis type batchq keeps there (:data:`KEY_TYPES`), for the keys of
        this queue called ``names`` (attributes: ``'meta'``, ``'data'``, ...)."""
        return {getattr(self, name): KEY_TYPES[name] for name in names}

    def data_of(self, rank: int, world: int) -> str:
        """Rank ``rank``'s data list (world 1: the data list)."""
        return self.data if world == 1 else f"{self.data}:{rank}"

    def trainer_of(self, rank: int, world: int) -> str:
        """Rank ``rank``'s figures (world 1: ``trainer``)."""
        return self.trainer if world == 1 else f"{self.trainer}:{rank}"

    def history_of(self, rank: int, world: int) -> str:
        """Rank ``rank``'s samples (world 1: ``history``)."""
        return self.history if world == 1 else f"{self.history}:{rank}"

    def rank_data(self, world: int) -> list[str]:
        """Every rank's data list of a run of ``world`` ranks (none for world 1)."""
        return [] if world == 1 else [self.data_of(r, world) for r in range(world)]

    def slot_view(self, slot: int) -> QueueKeys:
        """The keys as group slot ``slot`` reads the run: its data list(s), counters
        (``stats``; ``queue_stats`` stays the queue's), figures, history, ledger and
        counts; every other key is the queue's. Slot 0 is this object's own names (a
        run of one group, as before)."""
        if slot == 0:
            return self
        view = QueueKeys(self.queue)
        sfx = slot_suffix(slot)
        view.slot = slot
        for name in SLOT_KEYS:
            setattr(view, name, f"{getattr(self, name)}{sfx}")
        return view

    def slot_keys(self, slot: int, world: int) -> list[str]:
        """Every key of group slot ``slot`` whose ranks are at most ``world``, in the
        order the scripts read them (5 + 3 x L keys, L = world, plus one where world > 1:
        claim.lua and resume.lua find a slot's keys in their KEYS tail by that count):
        ledger, counts, each rank's data list, stats, each rank's figures, each rank's
        history, the remap (an elastic resume of the group), the wake list (last: a run
        that ends deletes it with the lists, a slot's figures stay). Where world > 1 each
        rank's names are followed by the world-1 name (``data@<i>``...): each group slot
        reads with its own world, so a slot of one rank is covered in a tail sent for
        more."""
        view = self.slot_view(slot)
        ranks = [(r, world) for r in range(world)] + ([(0, 1)] if world > 1 else [])
        return [
            view.ledger,
            view.counts,
            *(view.data_of(r, w) for r, w in ranks),
            view.stats,
            *(view.trainer_of(r, w) for r, w in ranks),
            *(view.history_of(r, w) for r, w in ranks),
            view.remap,
            view.wake,
        ]

    def lease(self, producer: str) -> str:
        """The lease list of producer ``producer``."""
        return self.leases[producer]

    def _lease(self, producer: str) -> str:
        return f"{self.base}:lease:{producer}"

    def _lease_tail(self, shape: tuple[int, int | tuple[int, ...]]) -> list[str]:
        groups, world = shape
        views = [self.slot_view(i) for i in range(max(groups, 1))]
        worlds = (world,) * len(views) if isinstance(world, int) else world
        return [
            *(v.ledger for v in views),
            *(v.data_of(r, w) for v, w in zip(views, worlds, strict=True) for r in range(w)),
            *(v.remap for v in views if groups or worlds[0] > 1),
        ]

    def _push_tail(self, aim: tuple[int, int, int]) -> list[str]:
        mask, rank, world = aim
        out: list[str] = []
        for slot in (i for i in range(mask.bit_length()) if mask >> i & 1):
            view = self.slot_view(slot)
            out += [view.data_of(rank, world), view.stats]
        return out

    def _slot_tail(self, shape: tuple[int, int]) -> list[str]:
        groups, world = shape
        out: list[str] = []
        for slot in range(max(groups, 1) + 1):
            out += self.slot_keys(slot, world)
        return out

    def frame(self, run: str, producer: str, seq: int) -> str:
        """The key of the ``seq``-th frame that ``producer`` stores by reference for
        ``run``: the run is in the name so that a trainer deleting an older run's frames
        never deletes one of the run it reads (:meth:`run_frames`)."""
        return f"{self.run_frames(run)}{producer}:{seq}"

    def run_frames(self, run: str) -> str:
        """The prefix of every frame stored by reference for ``run``."""
        return f"{self.frame_prefix}{run}:"

    @property
    def pattern(self) -> str:
        """A SCAN pattern matching every key of this queue (braces escaped)."""
        return f"{PREFIX}:\\{{{self.queue}\\}}:*"

    @property
    def frame_pattern(self) -> str:
        """A SCAN pattern matching this queue's frames stored by reference."""
        return f"{PREFIX}:\\{{{self.queue}\\}}:frame:*"

    def stripe(self, stripe: int, count: int) -> QueueKeys:
        """The keys of stripe ``stripe`` of this queue striped ``count`` ways (stripe 0:
        these)."""
        return self if stripe == 0 else QueueKeys(stripe_name(self.queue, stripe, count))

    def __repr__(self) -> str:
        return f"QueueKeys({self.queue!r})"
