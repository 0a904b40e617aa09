"""Status of each group of a run read by several groups (:mod:`batchq.protocol.groups`):
its claim, whether it reads the shared stream or is detached (its batches built for it
alone), how far it is behind the leading group, what was built for it alone, its depth,
stall, rate, epoch and verdict.

A status row (:mod:`batchq.monitoring.rows`) carries ``groups``, one object per group
with the fields of :data:`GROUP_FIELDS` (empty for a run of one group), and
``slowest_group``: the group furthest behind among those reading (lowest epoch, then
fewest batches in it; ties: the one that waits most), the one that sets the pace.
"""

from __future__ import annotations

from typing import Any

from batchq.monitoring.rank_rows import reader_fields
from batchq.monitoring.snapshot import QueueSnapshot
from batchq.protocol.fields import MetaField, StatsField
from batchq.protocol.groups import lag_batches
from batchq.protocol.words import as_int

__all__ = ["GROUP_FIELDS", "group_rows", "slowest_group"]

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
)


def group_rows(snap: QueueSnapshot) -> list[dict[str, Any]]:
    """One object per group (:data:`GROUP_FIELDS`); empty for a run of one group."""
    reading = [g for g in snap.groups if not g.done]
    lead = max((g.floor for g in reading), default=0)
    front = max((g.next for g in reading), default=0)
    shards = as_int(snap.meta.get(MetaField.SHARDS))
    epoch_batches = as_int(snap.meta.get(MetaField.EPOCH_BATCHES) or -1)
    rows = []
    for g in snap.groups:
        fields = reader_fields(snap, g)
        rows.append(
            {
                "group": g.name,
                "slot": g.slot,
                "trainer": fields["trainer"],
                "sharing": "alone" if not g.done and g.next < front else "shared",
                "lag_batches": 0.0 if g.done else lag_batches(lead, g.floor, epoch_batches, shards),
                "max_lag_batches": g.max_lag_batches,
                "solo_builds": g.stats.get(StatsField.SOLO_PUSHED, 0),
                "detached_drops": g.stats.get(StatsField.DETACHED_DROPS, 0),
                "pushed": g.stats.get(StatsField.PUSHED, 0),
                "popped": g.stats.get(StatsField.POPPED, 0),
                **fields,
            }
        )
    return [{name: row[name] for name in GROUP_FIELDS} for row in rows]  # documented order


def slowest_group(rows: list[dict[str, Any]]) -> str | None:
    """The group furthest behind among those reading (None: none is)."""
    reading = [r for r in rows if r["trainer"] == "attached"]
    if not reading:
        return None

    def behind(r: dict[str, Any]) -> tuple[int, int, float]:
        return (r["epoch"] or 0, r["epoch_progress"] or 0, -(r["stall"] or 0.0))

    return str(min(reading, key=behind)["group"])
