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
  (:func:`autoscale_field`); read by ``status`` and the exporter.
* :class:`TrainerField` -- ``bq:{Q}:trainer`` (``:trainer:<r>`` per rank), the
  trainer's recent figures: computed by :mod:`consumer.stats`, written by pop.lua about
  once a second with ``updated_ms`` (server ms), read by ``status``.

The Lua scripts spell the same names: a script reads and writes a hash by field name.
tests/batchq/protocol/test_fields.py reads every script and fails on a field of these hashes
that is not declared here, so a new field is added in one place and found by the rest.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MetaField",
    "StatsField",
    "TrainerField",
    "autoscale_field",
    "dead_field",
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
    NEXT: Final = "next"  # the next shard to mint
    FLOOR: Final = "floor"  # the trainer's oldest incomplete shard
    FINISHED: Final = "finished"  # '1' once the trainer finished the run
    FINISHED_AT: Final = "finished_at"  # when (server ms)
    CLAIM: Final = "claim"  # the trainer's claim token
    CLAIM_DEADLINE: Final = "claim_deadline"  # until when it holds (server ms)
    CLAIMED: Final = "claimed"  # a rank that claimed once (data-parallel runs)
    DONE: Final = "done"  # '1': a rank finished its share
    FENCE: Final = "fence"  # incremented by every claim
    WORLD: Final = "world"  # ranks of a data-parallel trainer
    EVEN: Final = "even"  # 'pad' or 'drop'
    RESUME_STEP: Final = "resume_step"  # the checkpoint step a data-parallel resume used
    REMAP_EPOCH: Final = "remap_epoch"  # the epoch the remap hash re-splits
    AXIS_LABELS: Final = "axis_labels"  # JSON source -> axis names (producers)
    SHM_HOST: Final = "shm_host"  # the trainer's shared-memory host identity
    SHM_LOOKAHEAD: Final = "shm_lookahead"  # the trainer's look-ahead, in frames

    #: Fields a data-parallel run keeps once per rank (``'<name>:<r>'``): ranks may
    #: run on different hosts, so each publishes its own shared-memory host.
    PER_RANK: Final = (CLAIM, CLAIM_DEADLINE, CLAIMED, DONE, NEXT, FLOOR, SHM_HOST, SHM_LOOKAHEAD)


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
    DROPPED_AHEAD: Final = "dropped_ahead"  # frames past the trainer's window (built again)
    EPOCHS_COMPLETED: Final = "epochs_completed"
    TRAINER_WAIT_MS: Final = "trainer_wait_ms"  # the trainer waiting for data
    TRAINER_BUSY_MS: Final = "trainer_busy_ms"  # the trainer between batches
    WAIT_BUCKET: Final = "wait_bucket"  # prefix: see wait_bucket_field
    DEAD: Final = "dead"  # prefix: see dead_field
    AUTOSCALE: Final = "autoscale"  # prefix: see autoscale_field


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
    UPDATED_MS: Final = "updated_ms"  # written by pop.lua: when (server ms)

    #: The figures the trainer publishes (consumer.stats), in order.
    PUBLISHED: Final = (
        EPOCH, EPOCH_PROGRESS, STALL_FRACTION_EPOCH, STALL_FRACTION_RECENT, WAIT_P50_S,
        WAIT_P90_S, WAIT_P99_S, BATCHES_PER_S, MB_PER_S,
    )  # fmt: skip
