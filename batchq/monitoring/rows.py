"""Reading a queue's state for people: status rows and their verdict (the table and the
other text are :mod:`batchq.monitoring.text`).

Reads go through :func:`batchq.monitoring.snapshot.read_snapshots` (one pipelined round trip for
all the queues, a second for lease lists and referenced frames); nothing here writes to
Redis. The verdict's rule and thresholds are in :mod:`batchq.monitoring.verdict`.

``status --json`` prints a list of objects, one per queue, with these fields in this
order (schema version 6; version 5 had the fields up to ``stripes``; version 4 had the
fields up to ``rebuilt_params``; version 3
had the fields up to ``shm_bytes``; version 2 had
the fields up to ``verdict_reason``, and
``host`` was not in the producer objects; version 1 had the first 13, with the same
meanings, and no ``schema`` field). Counters are cumulative since the queue's keys were
created: they are not reset between runs (``batchq reset`` deletes them).

    queue                 str          the queue's name
    run                   str          the run id ('' if none)
    depth                 int          LLEN of the data list (items)
    hwm                   int          the run's cap (0 if no producer joined yet)
    producers_alive       int          producers whose heartbeat deadline has not passed
    leases                int          shards leased right now by live producers
    shards_per_epoch      int          S (0 if unknown)
    epoch_batches         int          batches per epoch (0 if unknown)
    pushed                int          frames pushed
    popped                int          frames popped
    pushed_bytes          int          bytes pushed
    trainer               str          'attached', 'detached' or 'finished'
    dead                  int          frames in the dead list (capped)
    schema                int          6 (STATUS_SCHEMA_VERSION)
    popped_bytes          int          bytes popped
    bytes_held            int          estimate of the bytes in the data list (see below)
    fill                  float        depth / hwm (0.0 when hwm is 0)
    oldest_age_s          float|null   age of the oldest frame (see below); null when the
                                       list is empty or its header has no time
    producer_blocked_s    float        time producers spent blocked at the hwm (all)
    shards_done           int          shards whose last frame was pushed
    redone_shards         int          shards handed back to be built again
    epochs_completed      int          epochs the trainer finished
    dead_by_reason        object       {reason: frames} as counted by the trainer
    trainer_wait_s        float        time the trainer waited for data
    trainer_busy_s        float        time the trainer spent between batches (its work)
    figures_age_s         float|null   age of the trainer's figures below (null: none)
    stall                 float|null   fraction of its last 100 batches' time the trainer
                                       waited for data
    stall_epoch           float|null   the same over the current (or last) epoch
    trainer_batches_per_s float|null   batches the trainer took per second (last 100)
    trainer_mb_per_s      float|null   MB (1e6 bytes) the trainer took per second
    wait_p50_s            float|null   median wait per batch (last 100)
    wait_p90_s            float|null   90th percentile wait per batch
    wait_p99_s            float|null   99th percentile wait per batch
    epoch                 int|null     the trainer's current epoch
    epoch_progress        int|null     batches handed out in it
    epoch_fraction        float|null   epoch_progress / epoch_batches
    producers             list         live producers, by id: objects with the fields of
                                       PRODUCER_FIELDS (below)
    supply_batches_per_s  float|null   sum of the live producers' batches_per_s
    verdict               str          'input-bound', 'trainer-bound', 'balanced', 'idle'
                                       or 'unknown' (rule: batchq.monitoring.verdict)
    verdict_reason        str          one sentence: why (with the cause, when known)
    verdict_cause         str|null     'cpu-starved', 'transport-saturated' or
                                       'slow-producer' (rule: batchq.monitoring.verdict.cause)
    demand_batches_per_s  float|null   batches/s the trainer would take if it never
                                       waited: trainer_batches_per_s / (1 - stall)
    busy_ms_per_batch     float|null   the trainer's own work per batch (1000 / demand)
    producer_batches_per_s float|null  the observed pipeline rate of one producer (recent
                                       history samples, else the live producers' totals)
    delivered_batches_per_s float|null frames actually pushed per second (recent samples)
    recommended_producers int|null     producers that meet the demand at that rate, with
                                       a 5% margin (batchq.monitoring.sizing)
    producers_deficit     int|null     recommended_producers - producers_alive (negative:
                                       producers to spare)
    autoscalers           int          live `serve --workers auto` sharing the queue
    autoscale_added       int          workers they added (all, cumulative)
    autoscale_retired     int          workers they retired
    autoscale_last        object|null  their newest decision: t (unix s), scaler, action,
                                       count, workers, reason, figures (batchq.host.pool)
    shm_segments          int          the queue's shared-memory segments in /dev/shm (or
                                       --shm-dir) on the host that runs status (batchq.wire.shm)
    shm_bytes             int          bytes allocated to them
    world_size            int          the trainer's ranks (1: a single trainer)
    ranks                 list         per rank of a data-parallel trainer: objects with
                                       the fields of batchq.monitoring.reader_rows.RANK_FIELDS
                                       (empty for a single trainer)
    slowest_rank          int|null     the rank furthest behind (batchq.monitoring.reader_rows)
    figures_fresh         bool         figures_age_s <= verdict.FIGURES_FRESH_S (in
                                       batchq.monitoring): the stall and epoch
                                       describe the trainer now (the one rule the
                                       table, top, report and the exporter read; added
                                       to schema 4 at its end, nothing else moved)
    wait_buckets          list         the trainer's waits per batch, counted into the
                                       buckets of WAIT_BUCKETS_S and a last +Inf one,
                                       cumulative (the exporter's histogram); added to
                                       schema 4 at its end after figures_fresh
    lookahead_batches     int|null     D: how far past the trainer's position producers
                                       can have built, in global batch indices (the
                                       default distance of set_params; null until a
                                       producer published the plan); added to schema 4
                                       at its end, with the next two
    params_version        int          the run's params log's version (set_params
                                       calls recorded; 0 for none)
    rebuilt_params        int          frames built with params a later change made
                                       stale, dropped and built again (cumulative)
    groups                list         per group of a run read by several groups (a
                                       sweep's trials): objects with the fields of
                                       batchq.monitoring.reader_rows.GROUP_FIELDS (empty
                                       for a run of one group); schema 5 (each group's
                                       world_size at the end of its fields: schema 6)
    slowest_group         str|null     the reading group furthest behind, the one that
                                       sets the pace (batchq.monitoring.reader_rows)
    node                  str          where the queue is: the server's host:port (a
                                       cluster's master of the queue's slot; Sentinel's
                                       master); schema 5, after slowest_group
    stripes               list         a striped queue's stripes (batchq.protocol.stripes),
                                       stripe 0 first: objects with stripe, queue, node,
                                       depth (every rank's list), pushed, popped,
                                       producers_alive (empty when not striped; the row's
                                       other fields are stripe 0's); added after node
    quarantined           int          examples its dataset could not read, replaced by
                                       substitutes (on_sample_error='quarantine';
                                       cumulative; `batchq dead` lists the run's); schema 6
    cache_hits            int|null     examples the live producers read from their caches
                                       (producer.torch.cached; null: none caches); schema
                                       6, after quarantined, with the next four
    cache_misses          int|null     examples they built
    cache_hit_rate        float|null   cache_hits / (cache_hits + cache_misses)
    cache_bytes           int|null     bytes their cache directories hold (the largest
                                       figure per host, summed over hosts)
    cache_saved_s         float|null   build time the hits saved, less the reads' time
    first_batch_s         float|null   the trainer's time from its stream's first
                                       iteration to its first batch (consumer.stats);
                                       schema 6, after cache_saved_s
    cache_saved_ms_per_batch float|null the build time the caches saved per batch
                                       pushed, in ms: the caching producers'
                                       cache_saved_s over their batches; schema 6, after
                                       first_batch_s
    quarantined_run       int          the examples the current run quarantined (its
                                       quarantine hash's count, exact while its records
                                       fit; 0 when the hash is an earlier run's);
                                       schema 6, after cache_saved_ms_per_batch

For a run read by several groups the queue-level figures are the group in slot 0's (the
first to claim the run, whose keys keep the plain names); ``groups`` has every group's.

For a data-parallel trainer (world_size > 1) ``depth`` is the sum of the ranks' lists
and the trainer figures (stall, rates, epoch) are the slowest rank's.

A producer object (its counters cover its whole life; ids are unique per process):

    id                    str          the producer's id
    batches               int          frames it pushed
    bytes                 int          bytes it pushed
    build_s               float        time its pipeline spent building those batches
    blocked_s             float        time it spent blocked at the hwm
    build_ms_per_batch    float|null   build_s / batches, in ms
    batches_per_s         float|null   batches per second of pipeline time: the rate it
                                       reaches when it is never blocked
    blocked_fraction      float|null   blocked_s / (build_s + blocked_s)
    heartbeat_in_s        float        seconds until its heartbeat deadline
    host                  str          the host part of a default id (host-pid-random),
                                       else the whole id
    cache_hits            int|null     examples its cached stages read from the cache
                                       (null: it caches nothing), as of its last heartbeat
    cache_misses          int|null     examples they built
    cache_hit_rate        float|null   cache_hits / (cache_hits + cache_misses)
    cache_bytes           int|null     bytes its cache directory holds (all processes')
    cache_saved_s         float|null   build time its hits saved, less their reads' time
    first_push_s          float|null   from its start (its process's, or its fork from
                                       a warm pool) to its first push; null until its
                                       heartbeat wrote it (producer/serving/heartbeat.py);
                                       after cache_saved_s

``bytes_held``: Redis cannot give the size of a list element without sending it
(STRLEN works on strings only), so this is an estimate: depth times the mean frame size
of the live producers (their pstats bytes over batches; the queue's pushed_bytes over
pushed when none has pushed yet), and exactly 0 when the list is empty. Frames stored
by reference count with their full size. It is exact when the frames are of one size,
as batches of fixed shapes are. ``pushed_bytes - popped_bytes`` was the other candidate
and was not chosen: the trainer reports the bytes of a pop in its next call, so that
difference errs high by a whole pop (up to the trainer's hwm in frames), and, for good,
by the last pop of every trainer that closed and every frame it never fetched.

``oldest_age_s``: the Redis server's time minus the time the producer wrote into the
oldest frame's header (``LINDEX data -1``: for an inline frame that sends the whole
frame, at most 256 KiB; for a reference, ``GETRANGE key 0 65535`` of the frame it
names). It includes any clock difference between the producer's host and Redis'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import redis

from batchq.client.cluster import grouped, masters
from batchq.errors import ConfigError
from batchq.monitoring import STATUS_SCHEMA_VERSION, sizing  # the version: of the layout above
from batchq.monitoring.counters import (
    PRODUCER_FIELDS,
    bytes_held,
    cache_fields,
    counter_fields,
    figure_fields,
    live_totals,
    params_fields,
    producer_rows,
    quarantined_in_run,
    saved_ms_per_batch,
)
from batchq.monitoring.reader_rows import group_rows, rank_rows, slowest_group, slowest_rank
from batchq.monitoring.snapshot import QueueSnapshot, read_snapshots
from batchq.monitoring.verdict import RECENT_S, cause, judge
from batchq.monitoring.verdict import recent_depths as verdict_depths
from batchq.protocol.fields import HistoryField, MetaField, ProducerStat
from batchq.protocol.keys import PREFIX, QueueKeys, queue_from_meta_key
from batchq.protocol.layout import WAIT_BUCKETS_S
from batchq.protocol.words import as_int
from batchq.wire.shm import DEFAULT_SHM_DIR, segments_usage

__all__ = [
    "PRODUCER_FIELDS",
    "STATUS_FIELDS",
    "STATUS_SCHEMA_VERSION",
    "WAIT_BUCKETS_S",
    "list_queues",
    "queue_exists",
    "queue_status",
    "recent_depths",
    "require_queue",
    "row_from_snapshot",
    "status_rows",
    "trainer_state",
]


STATUS_FIELDS = (
    "queue", "run", "depth", "hwm", "producers_alive", "leases", "shards_per_epoch",
    "epoch_batches", "pushed", "popped", "pushed_bytes", "trainer", "dead",
    "schema", "popped_bytes", "bytes_held", "fill", "oldest_age_s", "producer_blocked_s",
    "shards_done", "redone_shards", "epochs_completed", "dead_by_reason", "trainer_wait_s",
    "trainer_busy_s", "figures_age_s", "stall", "stall_epoch", "trainer_batches_per_s",
    "trainer_mb_per_s", "wait_p50_s", "wait_p90_s", "wait_p99_s", "epoch", "epoch_progress",
    "epoch_fraction", "producers", "supply_batches_per_s", "verdict", "verdict_reason",
    "verdict_cause", "demand_batches_per_s", "busy_ms_per_batch", "producer_batches_per_s",
    "delivered_batches_per_s", "recommended_producers", "producers_deficit", "autoscalers",
    "autoscale_added", "autoscale_retired", "autoscale_last",
    "shm_segments", "shm_bytes", "world_size", "ranks", "slowest_rank", "figures_fresh",
    "wait_buckets", "lookahead_batches", "params_version", "rebuilt_params", "groups",
    "slowest_group", "node", "stripes", "quarantined", "cache_hits", "cache_misses",
    "cache_hit_rate", "cache_bytes", "cache_saved_s", "first_batch_s",
    "cache_saved_ms_per_batch", "quarantined_run",
)  # fmt: skip


def list_queues(client: redis.Redis) -> list[str]:
    """The names of every queue on the server (those with a meta hash; on a cluster,
    every master's), sorted; a striped queue once (its stripes are in its row)."""
    names = set()
    for node in masters(client):
        for key in node.scan_iter(match=QueueKeys.META_PATTERN, count=1000):
            name = queue_from_meta_key(key)
            if name is not None:
                names.add(name)
    return sorted(names)


def queue_exists(client: redis.Redis, queue: str) -> bool:
    """Whether ``queue`` exists on the server: any of its keys is there.

    Its meta hash or incarnation (what a producer's join or a trainer's claim creates)
    answers in one command; without them, any key of the queue (``bq:{Q}:*``, one SCAN
    of the master holding its slot) counts too: what a run left after its meta was
    lost or deleted (its history, its counters) is still the queue's, which ``status``
    shows and ``report`` plots. A queue none of whose keys is there does not exist:
    it never did, or ``batchq reset`` deleted it.
    """
    keys = QueueKeys(queue)
    with grouped(client, {queue: keys.meta}) as ((node, _),):
        if node.exists(keys.meta, keys.incarnation):
            return True
        return next(iter(node.scan_iter(match=keys.pattern, count=1000)), None) is not None


#: Queue names an error lists at most.
_NAMES_LISTED = 20


def require_queue(client: redis.Redis, queue: str, where: str) -> None:
    """Refuse a queue that does not exist (:func:`queue_exists`), naming the ones that do.

    Args:
        client: a client of the server.
        queue: the queue's name.
        where: the server, for the message (a URL with its password masked).

    Raises:
        ConfigError: no key of ``queue`` is there; the message lists the queues there
            (:func:`list_queues`, at most 20 names).
    """
    if queue_exists(client, queue):
        return
    names = list_queues(client)
    listed = ", ".join(names[:_NAMES_LISTED])
    if len(names) > _NAMES_LISTED:
        listed += f" (+{len(names) - _NAMES_LISTED} more)"
    there = f"the queues there: {listed}" if names else "there is no queue there"
    raise ConfigError(
        f"no queue {queue!r} at {where} (none of its keys, {PREFIX}:{{{queue}}}:*, is "
        f"there); {there}"
    )


def trainer_state(snap: QueueSnapshot) -> str:
    """'finished', 'attached' (a live claim; a rank's for data-parallel trainers) or
    'detached'."""
    if snap.meta.get(MetaField.FINISHED) == "1":
        return "finished"
    if snap.ranks:
        return (
            "attached" if any(r.claim_deadline_ms > snap.now_ms for r in snap.ranks) else "detached"
        )
    deadline = as_int(snap.meta.get(MetaField.CLAIM_DEADLINE))
    return "attached" if snap.meta.get(MetaField.CLAIM) and deadline > snap.now_ms else "detached"


def _as_slowest_rank(snap: QueueSnapshot, slowest: int | None) -> QueueSnapshot:
    """A data-parallel trainer's snapshot with the queue-level figures of its slowest
    rank and the depth of all its lists."""
    rank = snap.ranks[slowest if slowest is not None else 0]
    return dataclasses.replace(
        snap,
        depth=sum(r.depth for r in snap.ranks),
        trainer=rank.trainer,
        history=rank.history,
    )


def recent_depths(snap: QueueSnapshot) -> list[float]:
    """This read's depth and those of the trainer's history samples of the last RECENT_S."""
    return verdict_depths(snap.depth, snap.history, snap.now_ms / 1000)


def row_from_snapshot(snap: QueueSnapshot, shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, Any]:
    """One queue's status row (see the module docstring for the fields); its segments
    are counted in ``shm_dir``."""
    ranks = rank_rows(snap)
    slowest = slowest_rank(ranks)
    groups = group_rows(snap)
    if snap.ranks:
        snap = _as_slowest_rank(snap, slowest)
    meta, hwm = snap.meta, snap.hwm
    figures = figure_fields(snap)
    fresh = figures["figures_fresh"]
    trainer = trainer_state(snap)
    producers = producer_rows(snap)
    totals = live_totals(snap)
    rates = [p["batches_per_s"] for p in producers if p["batches_per_s"] is not None]
    verdict, reason = judge(
        trainer=trainer,
        producers_alive=len(snap.alive),
        depths=recent_depths(snap),
        hwm=hwm,
        stall=figures["stall"] if fresh else None,
    )
    shm_segments, shm_bytes = segments_usage(shm_dir, snap.queue)  # this host's
    row: dict[str, Any] = {
        "queue": snap.queue,
        "run": meta.get(MetaField.RUN, ""),
        "depth": snap.depth,
        "hwm": hwm,
        "producers_alive": len(snap.alive),
        "leases": snap.leases or 0,
        "shards_per_epoch": as_int(meta.get(MetaField.SHARDS)),
        "epoch_batches": as_int(meta.get(MetaField.EPOCH_BATCHES)),
        "trainer": trainer,
        "dead": snap.dead,
        "schema": STATUS_SCHEMA_VERSION,
        "bytes_held": bytes_held(snap, totals),
        "fill": snap.depth / hwm if hwm else 0.0,
        "oldest_age_s": snap.oldest_age_s,
        "producers": producers,
        "supply_batches_per_s": sum(rates) if rates else None,
        "verdict": verdict,
        "verdict_reason": reason,
        "shm_segments": shm_segments,
        "shm_bytes": shm_bytes,
        "world_size": snap.world,
        "ranks": ranks,
        "slowest_rank": slowest,
        "groups": groups,
        "slowest_group": slowest_group(groups),
        "node": snap.node,
        "stripes": [stripe.row() for stripe in snap.stripes],
        **counter_fields(snap.stats),
        **figures,
        **params_fields(snap),
        **cache_fields(producers),
        "cache_saved_ms_per_batch": saved_ms_per_batch(producers),
        "quarantined_run": quarantined_in_run(snap),
    }
    row.update(_sizing(snap, row, totals, fresh))
    return {name: row[name] for name in STATUS_FIELDS}  # the documented order


def _sizing(
    snap: QueueSnapshot, row: dict[str, Any], totals: dict[str, int], fresh: bool
) -> dict[str, Any]:
    """Demand, supply and the recommendation (batchq.monitoring.sizing), and the verdict's
    cause."""
    demand = sizing.demand_rate(row["trainer_batches_per_s"], row["stall"]) if fresh else None
    samples = sizing.recent_samples(snap.history, snap.now_ms / 1000 - RECENT_S)
    per_producer = sizing.producer_rate(
        samples, totals[ProducerStat.BATCHES], totals[ProducerStat.PRODUCE_MS]
    )
    recommended = sizing.recommended_producers(demand, per_producer)
    delivered = sizing.delivered_rate(samples)
    why = _cause(snap, row, samples, delivered)
    out: dict[str, Any] = {
        "verdict_cause": why[0] if why else None,
        "demand_batches_per_s": demand,
        "busy_ms_per_batch": None if demand is None else 1000.0 / demand,
        "producer_batches_per_s": per_producer,
        "delivered_batches_per_s": delivered,
        "recommended_producers": recommended,
        "producers_deficit": None if recommended is None else recommended - len(snap.alive),
        "autoscalers": snap.autoscalers,
        "autoscale_last": snap.last_decision,
    }
    if why:
        out["verdict_reason"] = f"{row['verdict_reason']}; {why[1]}"
    return out


def _cause(
    snap: QueueSnapshot,
    row: dict[str, Any],
    samples: list[dict[str, Any]],
    delivered: float | None,
) -> tuple[str, str] | None:
    """The verdict's cause (batchq.monitoring.verdict.cause) for this row."""
    # Only over samples with today's producers: after a join the delivered rate still
    # lags the new supply.
    today = all(s.get(HistoryField.PRODUCERS) == len(snap.alive) for s in samples)
    return cause(
        verdict=row["verdict"],
        depths=recent_depths(snap),
        hwm=snap.hwm,
        producers=row["producers"],
        samples=snap.history,
        supply=row["supply_batches_per_s"],
        delivered=delivered if today else None,
    )


def status_rows(
    client: redis.Redis, queues: list[str], shm_dir: str = DEFAULT_SHM_DIR
) -> list[dict[str, Any]]:
    """The status rows of ``queues``, read together (see :func:`read_snapshots`)."""
    return [row_from_snapshot(s, shm_dir) for s in read_snapshots(client, queues)]


def queue_status(client: redis.Redis, queue: str, shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, Any]:
    """One queue's status row (see the module docstring for the fields)."""
    return status_rows(client, [queue], shm_dir)[0]
