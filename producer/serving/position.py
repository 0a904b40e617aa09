"""The run a producer serves: one value, replaced whole at each join.

The producer's join (on its serving thread) makes a new :class:`RunPosition` and hands
it to its pushers (:meth:`producer.serving.pushing.ShardPusher.joined`), its transport
(:meth:`producer.serving.transport.Transport.joined`) and its heartbeat thread
(:meth:`producer.serving.heartbeat.Heartbeat.follow`, under the heartbeat's lock).
Nobody changes a position in place, so whoever reads one sees the run, incarnation and
world of one join; a run that more groups joined since gives a new position with the
same run and more ``groups`` (``Producer._regroup``).

The position also carries the run's cap on each data list, ``list_cap`` (Fuel's
``hwm`` argument): the producer's first position holds the cap it was given, each join
asks join.lua for it (which refuses a run with another) and passes it on to the next
position, and the transport sizes its pool by it. It is held nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunPosition"]


@dataclass(frozen=True)
class RunPosition:
    """The run a producer serves ('' before its first join)."""

    run: str = ""
    incarnation: str = ""
    world: int = 1  # ranks of the run's trainer (batchq/protocol/ranks.py)
    groups: int = 0  # group slots of a run read by several groups (batchq/protocol/groups.py)
    # Each group slot's ranks (slot 0's is ``world``): each group reads with its own.
    worlds: tuple[int, ...] = ()
    # The most elements each data list holds (the hwm); 1 where none was given.
    list_cap: int = 1

    def world_of(self, slot: int) -> int:
        """The ranks group slot ``slot`` reads with."""
        return self.worlds[slot] if 0 < slot < len(self.worlds) else self.world

    def slot_worlds(self) -> tuple[int, ...]:
        """Each group slot's ranks, slot 0 first (one slot in a run of one group)."""
        return tuple(self.world_of(i) for i in range(max(self.groups, 1)))
