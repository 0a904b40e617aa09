"""The readers of a run in its status row (:mod:`batchq.monitoring.rows`): each rank of a
data-parallel trainer and each group of a run read by several groups, as objects of their
own, from their snapshots (:mod:`batchq.monitoring.reader_snapshots`). Each says what a
queue's row says of its trainer (claim state, depth and fill, recent figures, verdict:
:func:`reader_fields`), for that reader alone.

**Ranks.** A run read by ``world > 1`` ranks has a data list and figures per rank
(:mod:`batchq.protocol.keys`); its row carries ``ranks``, one object per rank with the
fields of :data:`RANK_FIELDS`, and ``slowest_rank``: the rank furthest behind, the one a
collective op waits for.

**Groups** (:mod:`batchq.protocol.groups`): its claim, whether it reads the shared stream
or is detached (its batches built for it alone), how far it is behind the leading group,
what was built for it alone, its depth, stall, rate, epoch and verdict. The row carries
``groups``, one object per group with the fields of :data:`GROUP_FIELDS` (empty for a
run of one group), and ``slowest_group``: the group furthest behind among those reading,
the one that sets the pace.

The reader furthest behind: the lowest epoch, then the fewest batches in it; ties: the
one that waits most.
"""

from __future__ import annotations

from typing import Any, Protocol

from batchq.monitoring.reader_snapshots import GroupSnapshot
from batchq.monitoring.snapshot import QueueSnapshot
from batchq.monitoring.verdict import figures_fresh, judge, near_cap, recent_depths
from batchq.protocol.fields import MetaField, StatsField, TrainerField
from batchq.protocol.groups import lag_batches
from batchq.protocol.words import as_int

__all__ = [
    "GROUP_FIELDS",
    "RANK_FIELDS",
    "Reader",
    "group_rows",
    "rank_rows",
    "reader_fields",
    "slowest_group",
    "slowest_rank",
]

#: The fields of each object in a status row's ``ranks``, in order.
RANK_FIELDS = (
    "rank",  # int
    "depth",  # int: LLEN of its data list
    "fill",  # float: depth / hwm
    "trainer",  # 'attached', 'detached' or 'finished'
    "stall",  # float|null: fraction of its last 100 batches' time spent waiting
    "batches_per_s",  # float|null: batches it took per second (last 100)
    "epoch",  # int|null
    "epoch_progress",  # int|null: batches it yielded in that epoch
    "figures_age_s",  # float|null
    "verdict",  # as the queue's verdict (batchq.monitoring.verdict), for this rank alone
    "verdict_reason",  # str
)


#: The fields of each object in a status row's ``groups``, in order.
GROUP_FIELDS = (
    "group",  # str: its name ('' the default group: a trainer without group=)
    "slot",  # int: its slot in the run (slot 0 keeps the plain key names)
    "trainer",  # 'attached' (a live claim), 'detached' (none: crashed or closed), 'finished'
    "sharing",  # 'shared' (reads the shared stream) or 'alone' (detached from it: its
    # batches are built for it alone, until its cursor reaches the others')
    "lag_batches",  # float: batches its floor is behind the leading group's
    "max_lag_batches",  # int|null: its max_lag_batches (null: the others wait for it)
    "solo_builds",  # int: frames built for it alone (cumulative)
    "detached_drops",  # int: pushes that left out its full list while it lagged
    "depth",  # int: items in its data list(s)
    "fill",  # float: depth / hwm
    "pushed",  # int: frames pushed into its list (slot 0: the queue's frames pushed)
    "popped",  # int: frames it popped
    "stall",  # float|null: fraction of its last 100 batches' time spent waiting
    "batches_per_s",  # float|null: batches it took per second (last 100)
    "epoch",  # int|null
    "epoch_progress",  # int|null: batches it yielded in that epoch
    "figures_age_s",  # float|null
    "verdict",  # as the queue's verdict (batchq.monitoring.verdict), for this group alone
    "verdict_reason",  # str
    "world_size",  # int: its ranks (each group of a run reads with its own; at the end)
)


class Reader(Protocol):
    """One reader of a run as its row sees it: a rank or a group
    (:mod:`batchq.monitoring.reader_snapshots`)."""

    depth: int
    history: list[dict[str, Any]]
    claim_deadline_ms: int
    done: bool

    def figure(self, name: str) -> float | None:
        """One of its trainer's figures, None if absent or malformed."""


def _state(snap: QueueSnapshot, reader: Reader) -> str:
    """'finished' (the run or this reader), 'attached' (a live claim) or 'detached'."""
    if snap.meta.get(MetaField.FINISHED) == "1" or reader.done:
        return "finished"
    return "attached" if reader.claim_deadline_ms > snap.now_ms else "detached"


def reader_fields(snap: QueueSnapshot, reader: Reader) -> dict[str, Any]:
    """What a row of one reader of the run (a rank, a group) says of its trainer: its
    claim state, depth and fill, recent figures and verdict."""
    figure, depth, state = reader.figure, reader.depth, _state(snap, reader)
    updated = figure(TrainerField.UPDATED_MS)
    age = None if updated is None else max(0.0, (snap.now_ms - updated) / 1000)
    fresh = figures_fresh(age)
    stall = figure(TrainerField.STALL_FRACTION_RECENT)
    verdict, reason = judge(
        trainer=state,
        producers_alive=len(snap.alive),
        depths=recent_depths(depth, reader.history, snap.now_ms / 1000),
        hwm=snap.hwm,
        stall=stall if fresh else None,
    )
    epoch, progress = figure(TrainerField.EPOCH), figure(TrainerField.EPOCH_PROGRESS)
    return {
        "depth": depth,
        "fill": depth / snap.hwm if snap.hwm else 0.0,
        "trainer": state,
        "stall": stall,
        "batches_per_s": figure(TrainerField.BATCHES_PER_S),
        "epoch": None if epoch is None or epoch < 0 else int(epoch),
        "epoch_progress": None if progress is None else int(progress),
        "figures_age_s": age,
        "verdict": verdict,
        "verdict_reason": reason,
    }


def rank_rows(snap: QueueSnapshot) -> list[dict[str, Any]]:
    """One object per rank (:data:`RANK_FIELDS`); empty for a single trainer. A rank
    whose list is near its cap while another rank reads is ``unread`` where no trainer
    reads it: none holds its claim, or the one that holds it has sent no figures lately
    (:func:`~batchq.monitoring.verdict.figures_fresh`) while another's are fresh (a loop
    that reads on one rank only)."""
    rows = [{"rank": rank.rank, **reader_fields(snap, rank)} for rank in snap.ranks]
    attached = [r for r in rows if r["trainer"] == "attached"]
    sending = [r for r in attached if figures_fresh(r["figures_age_s"])]
    for row in rows:
        if not near_cap(row["depth"], snap.hwm):
            continue
        if row["trainer"] == "detached":
            others = [r["rank"] for r in attached]
            why = "no trainer reads it"
        elif row["trainer"] == "attached" and row not in sending:
            others = [r["rank"] for r in sending]
            age = row["figures_age_s"]
            since = "yet" if age is None else f"for {age:.0f} s"
            why = f"its trainer holds its claim but has sent no figures {since}"
        else:
            continue
        if not others:
            continue
        names = ", ".join(str(r) for r in others)
        row["verdict"] = "unread"
        row["verdict_reason"] = (
            f"its list is full ({row['depth']}/{snap.hwm}) and {why} while rank {names} "
            "reads: its share of the epoch goes unread (a wrapper that reads on one rank "
            "only, such as Accelerate's DataLoaderDispatcher, or a rank that never started)"
        )
    return rows


def slowest_rank(rows: list[dict[str, Any]]) -> int | None:
    """The rank furthest behind among those reading (None: none is)."""
    slowest = _slowest(rows)
    return None if slowest is None else int(slowest["rank"])


def _slowest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reader furthest behind among those reading: lowest epoch, then fewest batches
    in it; ties: the one that waits most (None: none reads)."""
    reading = [r for r in rows if r["trainer"] == "attached"]
    if not reading:
        return None

    def behind(r: dict[str, Any]) -> tuple[int, int, float]:
        return (r["epoch"] or 0, r["epoch_progress"] or 0, -(r["stall"] or 0.0))

    return min(reading, key=behind)


def group_rows(snap: QueueSnapshot) -> list[dict[str, Any]]:
    """One object per group (:data:`GROUP_FIELDS`); empty for a run of one group."""
    reading = [g for g in snap.groups if not g.done]
    # In shards of the plan: a rank's local shards are 1/world of them.
    lead = max((g.floor * g.world for g in reading), default=0)
    front = max((g.next * g.world for g in reading), default=0)
    return [_group_row(snap, g, lead, front) for g in snap.groups]


def _group_row(snap: QueueSnapshot, g: GroupSnapshot, lead: int, front: int) -> dict[str, Any]:
    """One group's object, in the documented order: ``lead`` is the leading group's
    floor, ``front`` the furthest cursor among the groups reading (in the plan's
    shards: a local shard times the group's world)."""
    shards = as_int(snap.meta.get(MetaField.SHARDS))
    epoch_batches = as_int(snap.meta.get(MetaField.EPOCH_BATCHES) or -1)
    fields = reader_fields(snap, g)
    row = {
        "group": g.name,
        "slot": g.slot,
        "world_size": g.world,
        "trainer": fields["trainer"],
        "sharing": "alone" if not g.done and g.next * g.world < front else "shared",
        "lag_batches": 0.0
        if g.done
        else lag_batches(lead, g.floor * g.world, epoch_batches, shards),
        "max_lag_batches": g.max_lag_batches,
        "solo_builds": g.stats.get(StatsField.SOLO_PUSHED, 0),
        "detached_drops": g.stats.get(StatsField.DETACHED_DROPS, 0),
        "pushed": g.stats.get(StatsField.PUSHED, 0),
        "popped": g.stats.get(StatsField.POPPED, 0),
        **fields,
    }
    return {name: row[name] for name in GROUP_FIELDS}


def slowest_group(rows: list[dict[str, Any]]) -> str | None:
    """The group furthest behind among those reading (None: none is)."""
    slowest = _slowest(rows)
    return None if slowest is None else str(slowest["group"])
