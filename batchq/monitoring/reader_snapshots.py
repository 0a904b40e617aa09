"""The readers of a run, read with their queue's snapshot (:mod:`batchq.monitoring.snapshot`):
each rank of a data-parallel trainer (:class:`RankSnapshot`) and each group of a run read
by several groups (:class:`GroupSnapshot`, :mod:`batchq.protocol.groups`). A rank: its
list's depth, its trainer's figures and recent samples, its claim. A group: its list
depth, its counters, its trainer's figures and recent samples (those of its rank 0), and
what meta says of it (claims, cursor, floor, max_lag_batches). The rows made of them:
:mod:`batchq.monitoring.reader_rows`.

The snapshot's first round trip reads meta (the world size) and the registry of groups
(group name -> slot); these reads go in its second, one rank or group after another:
``queue_*_reads`` queues a reader's reads into the pipeline, ``file_*_read`` files each
reply into its snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from batchq.protocol.words import as_int, as_text

__all__ = [
    "GroupSnapshot",
    "RankSnapshot",
    "file_group_read",
    "file_rank_read",
    "history_range",
    "queue_group_reads",
    "queue_rank_reads",
    "samples",
    "texts",
]


def history_range(history: int) -> tuple[int, int]:
    """The LRANGE bounds of the ``history`` newest samples (-1: all; 0: an empty range,
    so the pipeline keeps its shape without sending a sample)."""
    if history == 0:
        return 1, 0
    return 0, history - 1 if history > 0 else -1


@dataclass
class RankSnapshot:
    """One rank of a data-parallel trainer (world > 1), read with its queue.

    Attributes:
        rank: the rank.
        depth: LLEN of its data list.
        trainer: its figures (as the queue's trainer hash).
        history: its history samples, newest first.
        claim_deadline_ms: its claim's deadline (0: none).
        done: it finished the run (``close(finished=True)``).
    """

    rank: int
    depth: int
    trainer: dict[str, str]
    history: list[dict[str, Any]]
    claim_deadline_ms: int
    done: bool

    def figure(self, name: str) -> float | None:
        """One of the rank's figures as a float, None if absent or malformed."""
        try:
            return float(self.trainer[name])
        except (KeyError, ValueError):
            return None


def queue_rank_reads(pipe: Any, k: QueueKeys, world: int, history: int) -> list[str]:
    """Queue the reads of each rank of a data-parallel trainer (none for one trainer);
    what each is, in order, for :func:`file_rank_read`."""
    what: list[str] = []
    for r in range(world if world > 1 else 0):
        pipe.llen(k.data_of(r, world))
        pipe.hgetall(k.trainer_of(r, world))
        pipe.lrange(k.history_of(r, world), *history_range(history))
        what += ["rank_depth", "rank_trainer", "rank_history"]
    return what


def file_rank_read(
    ranks: list[RankSnapshot], what: str, value: Any, meta: dict[str, str], world: int
) -> None:
    """File one of a rank's three reads (depth first, which starts the rank) into
    ``ranks``, its claim from ``meta``."""
    if what == "rank_depth":
        r = len(ranks)
        ranks.append(
            RankSnapshot(
                rank=r,
                depth=int(value),
                trainer={},
                history=[],
                claim_deadline_ms=as_int(meta.get(rank_field(MetaField.CLAIM_DEADLINE, r, world))),
                done=meta.get(rank_field(MetaField.DONE, r, world)) == "1",
            )
        )
    elif what == "rank_trainer":
        ranks[-1].trainer = texts(value)
    else:
        ranks[-1].history = samples(value)


def samples(raw: list[bytes]) -> list[dict[str, Any]]:
    """History entries as samples (JSON objects; the others skipped)."""
    out = []
    for item in raw:
        try:
            sample = json.loads(item)
        except ValueError:
            continue
        if isinstance(sample, dict):
            out.append(sample)
    return out


def texts(raw: dict[Any, Any]) -> dict[str, str]:
    """A hash as read (bytes or text) as text, field and value."""
    return {as_text(a): as_text(b) for a, b in raw.items()}


@dataclass
class GroupSnapshot:
    """One group of a run, read with its queue.

    Attributes:
        name: the group's name ('' the default group).
        slot: its slot in the run.
        depth: the items in its data lists (every rank's).
        stats: its counters (slot 0: the queue's stats hash, which holds them).
        trainer: its (rank 0's) figures.
        history: its (rank 0's) samples, newest first.
        claim_deadline_ms: the latest deadline among its ranks' claims (0: none).
        done: every rank of it finished.
        next: its (rank 0's) cursor: the next local shard minted for it.
        floor: its (rank 0's) floor: its oldest incomplete local shard.
        max_lag_batches: its max_lag_batches (None: the others wait for it).
        world: its ranks (each group of a run reads with its own).
    """

    name: str
    slot: int
    depth: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    trainer: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    claim_deadline_ms: int = 0
    done: bool = False
    next: int = 0
    floor: int = 0
    max_lag_batches: int | None = None
    world: int = 1

    def figure(self, name: str) -> float | None:
        """One of the group's figures as a float, None if absent or malformed."""
        try:
            return float(self.trainer[name])
        except (KeyError, ValueError):
            return None


def _from_meta(name: str, slot: int, meta: dict[str, str], world: int) -> GroupSnapshot:
    """A group's snapshot with what meta says of it."""

    def field_of(key: str, rank: int = 0) -> str | None:
        return meta.get(reader_field(key, slot, rank, world))

    lag = meta.get(reader_field(MetaField.MAX_LAG, slot))
    return GroupSnapshot(
        name=name,
        slot=slot,
        claim_deadline_ms=max(as_int(field_of(MetaField.CLAIM_DEADLINE, r)) for r in range(world)),
        done=all(field_of(MetaField.DONE, r) == "1" for r in range(world)),
        next=as_int(field_of(MetaField.NEXT)),
        floor=as_int(field_of(MetaField.FLOOR)),
        max_lag_batches=None if lag is None else as_int(lag),
        world=world,
    )


def queue_group_reads(
    pipe: Any, keys: QueueKeys, registry: dict[str, str], meta: dict[str, str], history: int
) -> list[GroupSnapshot]:
    """Queue the reads of every group of the registry (name -> slot) into ``pipe``
    (by slot: one LLEN per rank, then its stats, figures and samples: what
    :func:`file_group_read` files as ``group_depth``, ``group_stats``, ``group_trainer``,
    ``group_history``); the groups, their fields from meta filled."""

    def world_of(slot: int) -> int:  # each group reads with its own ranks
        return max(1, as_int(meta.get(reader_field(MetaField.WORLD, slot)) or 1))

    groups = sorted(
        (_from_meta(name, as_int(s), meta, world_of(as_int(s))) for name, s in registry.items()),
        key=lambda g: g.slot,
    )
    for group in groups:
        view = keys.slot_view(group.slot)
        world = world_of(group.slot)
        for r in range(world):
            pipe.llen(view.data_of(r, world))
        pipe.hgetall(view.stats)
        pipe.hgetall(view.trainer_of(0, world))
        pipe.lrange(view.history_of(0, world), *history_range(history))
    return groups


def file_group_read(group: GroupSnapshot, what: str, value: Any) -> None:
    """File one of a group's reads (what :func:`queue_group_reads` queued)."""
    if what == "group_depth":  # one per rank
        group.depth += int(value)
    elif what == "group_stats":
        group.stats = {as_text(a): as_int(b) for a, b in value.items()}
    elif what == "group_trainer":
        group.trainer = texts(value)
    else:
        group.history = samples(value)
