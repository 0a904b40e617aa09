"""What the reader thread is given when reading starts: its settings as one value, the
bound of its waits (``BLOCK_S``), and its view of the run it reads (:class:`RunView`).

The reader is a lower layer than the stream's session: it knows the run through
:class:`RunView` alone (the trainer's session is one), never the session's module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import redis

from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import RankLayout
from consumer.plan import Plan
from consumer.stream_options import StreamOptions

__all__ = ["BLOCK_S", "ReaderSettings", "RunView"]

# When the list is empty the reader blocks on BRPOP this long at most, so that the claim
# is refreshed and a lost producer is noticed; well below the socket timeout. Every wait
# of the trainer's (for a frame, for the plan) wakes this often.
BLOCK_S = 0.2


@dataclass(frozen=True)
class ReaderSettings:
    """The reader's settings, fixed when reading starts (the stream's, at its first epoch).

    Attributes:
        options: the stream's options (the reader reads hwm, the trainer's prefetch
            bound; timeout_s, after which ProducersLost is raised with no producer
            alive, also the bound of a reconnect and of the wait for a replaced key's
            repair; max_frame_bytes, above which frames go to the dead list undecoded;
            on_bad_frame, 'raise' or 'skip'; stall_s, after which without a frame
            dead producers are reaped and shards with a gap handed back).
        writable: writable arrays: frames stored by reference are received into buffers
            of their own (no copy); frames inside the list are copied once (the
            stream's frame preparation says, as set before the first epoch).
        layout: a data-parallel job's split: the ledger holds this rank's local shards.
            None for a single trainer (a layout of world 1 is stored as None).
    """

    options: StreamOptions
    writable: bool = False
    layout: RankLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.world == 1:
            # Ranks of a data-parallel job read their own list and renumber their slots
            # as local shards; a single trainer does neither.
            object.__setattr__(self, "layout", None)


class RunView(Protocol):
    """The run a reader reads, as it sees it: the claim's keys and figures, the run's
    plan, and the calls that keep the claim (the trainer's session is one; its reader
    thread is the only other thread that calls them).

    Attributes:
        keys: the keys the claim reads (a group's slot: its own).
        data_key: the list this rank pops.
        rank, world: this rank of the job's ranks.
        run, incarnation, token, suffix, claim_ttl_ms: the claim, as the pop script
            checks it (``suffix``: a rank's meta fields end in it).
        plan: what the producers published of the run (None before).
        slot: the group slot the claim reads (0: the run's first group).
        grouped: the run is read by several groups (frames stored once for all).
        remap: (epoch, slot -> shard) the run was resumed with (an elastic resume's),
            or None; remap_done: that epoch's slots past it, done (ledger pairs).
    """

    keys: QueueKeys
    data_key: str
    rank: int
    world: int
    run: str
    incarnation: str
    token: str
    suffix: str
    claim_ttl_ms: int
    plan: Plan | None
    slot: int
    grouped: bool
    remap: tuple[int, dict[int, int]] | None
    remap_done: list[tuple[str, str]]

    @property
    def what(self) -> str:
        """The claim, for messages ('queue Q[ group G][ rank r]')."""

    def refresh(self, client: redis.Redis) -> None:
        """Keep the claim alive (idle; every pop refreshes it too)."""

    def reclaim(self, client: redis.Redis) -> None:
        """Claim again after Redis lost the queue (a :meth:`resume` follows)."""

    def resume(
        self,
        client: redis.Redis,
        first_shard: int,
        fingerprint: str,
        ledger: Iterable[tuple[str, str]],
        *,
        step: int = 0,
        shards: int | None = None,
        remap: tuple[int, dict[int, int]] | None = None,
    ) -> None:
        """Re-create the run at ``first_shard`` from the ledger's pairs."""

    def saw_groups(self, groups: int) -> None:
        """A pop said the run is read by ``groups`` group slots."""
