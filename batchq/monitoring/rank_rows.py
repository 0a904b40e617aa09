"""Status of each rank of a data-parallel trainer: depth, stall, rate, verdict.

A run read by ``world > 1`` ranks has a data list and figures per rank
(:mod:`batchq.protocol.keys`); its status row (:mod:`batchq.monitoring.rows`) carries ``ranks``, one
object per rank with the fields of :data:`RANK_FIELDS`, and ``slowest_rank``: the rank
furthest behind (lowest epoch, then fewest batches in it; ties: the one that waits
most), the one a collective op waits for.
"""

from __future__ import annotations

from typing import Any, Protocol

from batchq.monitoring.snapshot import QueueSnapshot
from batchq.monitoring.verdict import FIGURES_FRESH_S, judge, near_cap, recent_depths
from batchq.protocol.fields import MetaField, TrainerField

__all__ = ["RANK_FIELDS", "Reader", "rank_rows", "reader_fields", "slowest_rank"]

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


class Reader(Protocol):
    """One reader of a run as its row sees it: a rank (:class:`RankSnapshot`) or a group
    (:class:`~batchq.monitoring.group_snapshot.GroupSnapshot`)."""

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
    fresh = age is not None and age <= FIGURES_FRESH_S
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
    whose list is near its cap with no trainer while another rank reads is ``unread``."""
    rows = [{"rank": rank.rank, **reader_fields(snap, rank)} for rank in snap.ranks]
    reading = [r["rank"] for r in rows if r["trainer"] == "attached"]
    for row in rows:
        if row["trainer"] == "detached" and reading and near_cap(row["depth"], snap.hwm):
            names = ", ".join(str(r) for r in reading)
            row["verdict"] = "unread"
            row["verdict_reason"] = (
                f"its list is full ({row['depth']}/{snap.hwm}) and no trainer reads it while "
                f"rank {names} reads: its share of the epoch goes unread (a wrapper that "
                "reads on one rank only, such as Accelerate's DataLoaderDispatcher, or a "
                "rank that never started)"
            )
    return rows


def slowest_rank(rows: list[dict[str, Any]]) -> int | None:
    """The rank furthest behind among those reading (None: none is)."""
    reading = [r for r in rows if r["trainer"] == "attached"]
    if not reading:
        return None

    def behind(r: dict[str, Any]) -> tuple[int, int, float]:
        return (r["epoch"] or 0, r["epoch_progress"] or 0, -(r["stall"] or 0.0))

    return int(min(reading, key=behind)["rank"])
