"""The field names of the hashes that more than one module reads, written down once.

:mod:`batchq.protocol.keys` names the keys and :mod:`batchq.protocol.layout` the value formats; this
module names the fields of:

* :class:`MetaField` -- ``bq:{Q}:meta``, the run: written by join, claim and resume.lua
  (and the producers' axis labels, the trainer's shared-memory host), read by the
  other scripts, the trainer's session and ``status``. A data-parallel run (world > 1)
  has one of each :data:`MetaField.PER_RANK` field per rank, named by
  :func:`batchq.protocol.ranks.rank_field` (``'<name>:<r>'``).
* :class:`StatsField` -- ``bq:{Q}:stats``, cumulative counters: incremented by the
  scripts, the reader's dead list (:func:`dead_field`) and the autoscaler
  (:func:`autoscale_field`); read by ``status`` and the exporter. A group slot i >= 1
  of a run read by several groups has its own (``stats@<i>``): its trainer's counters,
  and ``pushed`` counts the frames pushed into its lists.
* :class:`TrainerField` -- ``bq:{Q}:trainer`` (``:trainer:<r>`` per rank), the
  trainer's recent figures: computed by :mod:`consumer.stats`, written by pop.lua about
  once a second with ``updated_ms`` (server ms), read by ``status``.
* :class:`ProducerStat` -- ``bq:{Q}:pstats``, each producer's counters, field
  :func:`producer_stat_field` (``'<p>:<name>'``): incremented by push.lua, summed over
  the live producers by pop.lua (into each history sample), read by ``status``;
  beside them :class:`ProducerFigure`, what a producer writes there itself (its time to
  its first push).
* :class:`HistoryField` -- the fields of a history sample (``bq:{Q}:history``, a JSON
  object a second): the trainer's side written by :mod:`consumer.stats`, the queue side
  added by pop.lua; read by ``status`` (:mod:`batchq.monitoring.sizing`), ``top`` and
  ``report``.

The Lua scripts spell the same names: a script reads and writes a hash by field name.
tests/batchq/protocol/test_fields.py reads every script and fails on a field of these hashes
that is not declared here (and on a per-producer counter or a sample field pop.lua adds
that is not), so a new field is added in one place and found by the rest.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "HistoryField",
    "MetaField",
    "ProducerFigure",
    "ProducerStat",
    "StatsField",
    "TrainerField",
    "autoscale_field",
    "dead_field",
    "parse_producer_stat_field",
    "producer_stat_field",
    "wait_bucket_field",
]


class MetaField:
    """The fields of a queue's meta hash."""

    VERSION: Final = "version"  # the protocol version of the run's producers
    RUN: Final = "run"  # the run id
    FINGERPRINT: Final = "fingerprint"  # the pipeline's plan fingerprint
    HWM: Final = "hwm"  # the data list's cap
    SHARDS: Final = "shards"  # S, shards per epoch
    WINDOW: Final = "window"  # W, the look-ahead in shards past the floor
    EPOCH_BATCHES: Final = "epoch_batches"  # batches per epoch, -1 if unknown
    STRIPES: Final = "stripes"  # the run's stripes (batchq/protocol/stripes.py)
    NEXT: Final = "next"  # the next shard to mint
    FLOOR: Final = "floor"  # the trainer's oldest incomplete shard
    FINISHED: Final = "finished"  # '1' once the trainer finished the run
    FINISHED_AT: Final = "finished_at"  # when (server ms)
    CLAIM: Final = "claim"  # the trainer's claim token
    CLAIM_DEADLINE: Final = "claim_deadline"  # until when it holds (server ms)
    CLAIMED: Final = "claimed"  # a rank that claimed once (data-parallel runs)
    CLAIM_CLIENT: Final = "claim_client"  # the claim holder's connection name (SETNAME)
    DONE: Final = "done"  # '1': a rank finished its share
    FENCE: Final = "fence"  # incremented by every claim
    WORLD: Final = "world"  # ranks of a data-parallel trainer
    EVEN: Final = "even"  # 'pad' or 'drop'
    RESUME_STEP: Final = "resume_step"  # the checkpoint step a data-parallel resume used
    REMAP_EPOCH: Final = "remap_epoch"  # the epoch the remap hash re-splits
    # '1' once some group slot of the run differs from slot 0 in world, even or remap:
    # lease.lua then reads each slot's (else they are slot 0's: no read per slot)
    MIXED_WORLDS: Final = "mixed_worlds"
    AXIS_LABELS: Final = "axis_labels"  # JSON source -> axis names (producers)
    SHM_HOST: Final = "shm_host"  # the trainer's shared-memory host identity
    SHM_LOOKAHEAD: Final = "shm_lookahead"  # the trainer's look-ahead, in frames
    GROUPS: Final = "groups"  # the group slots of a run read by several groups
    MAX_LAG: Final = "max_lag"  # a group's max_lag_batches ('<name>@<i>' per slot)
    SHARD_BATCHES: Final = "shard_batches"  # B, batches per full shard (0: unknown)
    PARAMS: Final = "params"  # the params log's stamp '<run>:<version>' (params.lua)
    # '<run>:<digest>': a single trainer detached from the run, its unread frames given
    # back (detach.lua); a resume from the state of that digest (its state_dict() and
    # shared-memory host: consumer/checkpoint.py) takes the run over as it is
    DETACHED: Final = "detached"

    #: Fields a data-parallel run keeps once per rank (``'<name>:<r>'``): ranks may
    #: run on different hosts, so each publishes its own shared-memory host.
    PER_RANK: Final = (CLAIM, CLAIM_DEADLINE, CLAIMED, DONE, NEXT, FLOOR, SHM_HOST, SHM_LOOKAHEAD)
    #: Fields a run of several groups keeps once per group slot i >= 1 (``'<name>@<i>'``,
    #: and per rank ``'<name>@<i>:<r>'`` for the PER_RANK ones; slot 0: the plain names,
    #: :func:`batchq.protocol.groups.reader_field`).
    PER_GROUP: Final = (*PER_RANK, MAX_LAG, RESUME_STEP, WORLD, EVEN, REMAP_EPOCH)


class StatsField:
    """The counters of a queue's stats hash (cumulative since the keys were created)."""

    PUSHED: Final = "pushed"  # frames pushed
    PUSHED_BYTES: Final = "pushed_bytes"
    POPPED: Final = "popped"  # frames popped
    POPPED_BYTES: Final = "popped_bytes"
    PRODUCER_BLOCKED_MS: Final = "producer_blocked_ms"  # producers at the hwm, all
    SHARDS_DONE: Final = "shards_done"  # shards whose last frame was pushed
    REDONE_SHARDS: Final = "redone_shards"  # shards handed back to be built again
    FAILED_ATTEMPTS: Final = "failed_attempts"  # shard attempts whose pipeline raised
    REAPED_CLOSED: Final = "reaped_closed"  # producers reaped for closed connections
    QUARANTINED: Final = "quarantined"  # examples replaced by a substitute (quarantine)
    # Leases of an earlier (or finished) run a reap dropped instead of handing them to
    # the queue's current run (a killed producer's lease list outlives its run).
    STALE_LEASES: Final = "stale_leases"
    # Frames a single trainer that detached gave back to the list (popped again later).
    GIVEN_BACK: Final = "given_back"
    DROPPED_AHEAD: Final = "dropped_ahead"  # frames past the trainer's window (built again)
    REBUILT_PARAMS: Final = "rebuilt_params"  # frames built with params since changed
    EPOCHS_COMPLETED: Final = "epochs_completed"
    TRAINER_WAIT_MS: Final = "trainer_wait_ms"  # the trainer waiting for data
    TRAINER_BUSY_MS: Final = "trainer_busy_ms"  # the trainer between batches
    WAIT_BUCKET: Final = "wait_bucket"  # prefix: see wait_bucket_field
    DEAD: Final = "dead"  # prefix: see dead_field
    AUTOSCALE: Final = "autoscale"  # prefix: see autoscale_field
    # A group's own counters (its stats hash; slot 0: the queue's), pushed by push.lua:
    SOLO_PUSHED: Final = "solo_pushed"  # frames built for this group alone (detached, late)
    DETACHED_DROPS: Final = "detached_drops"  # pushes that left out its full list (detached)


def wait_bucket_field(i: int) -> str:
    """The counter of the trainer's waits in bucket ``i`` of ``WAIT_BUCKETS_S``
    (batchq.protocol.layout; the last one, ``i == len(WAIT_BUCKETS_S)``, is +Inf)."""
    return f"{StatsField.WAIT_BUCKET}:{i}"


def dead_field(reason: str) -> str:
    """The counter of bad frames the trainer refused for ``reason``."""
    return f"{StatsField.DEAD}:{reason}"


def autoscale_field(action: str) -> str:
    """The counter of workers an autoscaler decided to ``action`` ('add', 'retire')."""
    return f"{StatsField.AUTOSCALE}_{action}"


class TrainerField:
    """The trainer's figures (its trainer hash; see consumer.stats for their meaning)."""

    EPOCH: Final = "epoch"
    EPOCH_PROGRESS: Final = "epoch_progress"
    STALL_FRACTION_EPOCH: Final = "stall_fraction_epoch"
    STALL_FRACTION_RECENT: Final = "stall_fraction_recent"
    WAIT_P50_S: Final = "wait_p50_s"
    WAIT_P90_S: Final = "wait_p90_s"
    WAIT_P99_S: Final = "wait_p99_s"
    BATCHES_PER_S: Final = "batches_per_s"
    MB_PER_S: Final = "mb_per_s"
    FIRST_BATCH_S: Final = "first_batch_s"  # first iteration -> first batch
    UPDATED_MS: Final = "updated_ms"  # written by pop.lua: when (server ms)

    #: The figures the trainer publishes (consumer.stats), in order.
    PUBLISHED: Final = (
        EPOCH, EPOCH_PROGRESS, STALL_FRACTION_EPOCH, STALL_FRACTION_RECENT, WAIT_P50_S,
        WAIT_P90_S, WAIT_P99_S, BATCHES_PER_S, MB_PER_S, FIRST_BATCH_S,
    )  # fmt: skip


class ProducerStat:
    """The counters of one producer in a queue's pstats hash (push.lua; cumulative)."""

    BATCHES: Final = "batches"  # frames it pushed
    BYTES: Final = "bytes"  # bytes it pushed
    PRODUCE_MS: Final = "produce_ms"  # its pipeline's time building those frames
    BLOCKED_MS: Final = "blocked_ms"  # its time blocked at the hwm

    #: Every counter, in the order push.lua increments them.
    ALL: Final = (BLOCKED_MS, BATCHES, BYTES, PRODUCE_MS)

    # A producer's cached stages (producer.torch_cache), summed over its process; set
    # (not incremented) by its heartbeat thread, absent when it caches nothing.
    CACHE_HITS: Final = "cache_hits"  # examples read from the cache
    CACHE_MISSES: Final = "cache_misses"  # examples built
    CACHE_BYTES: Final = "cache_bytes"  # the bytes its cache directory holds
    CACHE_SAVED_MS: Final = "cache_saved_ms"  # build time the hits saved, less their reads

    #: The cache's counters, in the order the heartbeat writes them.
    CACHE: Final = (CACHE_HITS, CACHE_MISSES, CACHE_BYTES, CACHE_SAVED_MS)


class ProducerFigure:
    """What a producer writes itself into the pstats hash (beside push.lua's counters,
    under :func:`producer_stat_field` names; producer/serving/heartbeat.py)."""

    FIRST_PUSH_MS: Final = "first_push_ms"  # from its start to its first push, written once


def producer_stat_field(producer: str, name: str) -> str:
    """The pstats field of ``producer``'s counter ``name`` (one of :class:`ProducerStat`)."""
    return f"{producer}:{name}"


def parse_producer_stat_field(field: str) -> tuple[str, str] | None:
    """(producer, counter name) of a pstats field, None for a field without a ``':'``.

    Producer ids have no colon (:func:`batchq.protocol.keys.check_name`): the counter is
    what follows the last one.
    """
    producer, sep, name = field.rpartition(":")
    return (producer, name) if sep else None


class HistoryField:
    """The fields of a history sample (a JSON object; newest first in the history list)."""

    # The trainer's side (consumer.stats), about once a second while it pops.
    T: Final = "t"  # the trainer's wall clock (unix s)
    DEPTH: Final = "depth"  # the data list's length before its pop
    BATCHES: Final = "batches"  # batches it took so far
    STALL: Final = "stall"  # its recent stall fraction
    BATCHES_PER_S: Final = "batches_per_s"  # its recent rate
    MB_PER_S: Final = "mb_per_s"
    # The queue's side, added by pop.lua at that moment.
    PRODUCERS: Final = "producers"  # producers alive
    PUSHED: Final = "pushed"  # the stats hash's frames pushed
    BUILT: Final = "built"  # the live producers' summed batches (ProducerStat.BATCHES)
    BUILD_MS: Final = "build_ms"  # and pipeline time (ProducerStat.PRODUCE_MS)

    #: The fields the trainer writes, and those pop.lua adds.
    TRAINER_SIDE: Final = (T, DEPTH, BATCHES, STALL, BATCHES_PER_S, MB_PER_S)
    QUEUE_SIDE: Final = (PRODUCERS, PUSHED, BUILT, BUILD_MS)
