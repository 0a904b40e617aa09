"""Data-parallel trainers: how one run's plan is split among ``world`` ranks.

Written down once, for the producer, the trainer and the Lua scripts (which receive what
they need from meta: ``world``, ``even``, ``shards``).

- An epoch has ``slots`` slots: ``world * ceil(S / world)`` with ``even='pad'``,
  ``world * floor(S / world)`` with ``'drop'`` (S = shards per epoch). Slot ``s`` below S
  is shard ``s``; a slot past S is a *pad* and rebuilds shard ``(s - S) % S``, the
  epoch plan's first shards, as torch's DistributedSampler pads with the first indices.
  With ``'drop'`` the last ``S - slots`` shards of each epoch are served to nobody.
- Slot ``s`` belongs to rank ``s % world``: rank r's share of an epoch is the slots r,
  r + world, r + 2 world, ... in plan order; its ``P = slots / world`` slots are its
  *local* shards ``j = s // world``, so a rank's trainer sees an ordinary plan of P
  shards per epoch and its ledger, floor and state are in those local terms.
- Global slot numbers ``G = epoch * slots + s`` name work in Redis (leases, the work
  list, the ledger hash's ``'<epoch>:<slot>'`` fields, frame headers' shard = s); a
  rank's counters (``next:<r>``, ``floor:<r>``) count its local shards
  ``n = epoch * P + j``.
- World 1 is the single trainer of before: slots = S, G = n, and the per-rank meta
  fields and keys are the plain ones (``next``, ``floor``, ``claim``, ``data``...).

The run's *global batch index* (what ``set_params`` indices count,
:class:`BatchNumbering`) numbers batches in the same global numbering: batch k of slot
G is ``G * B + k``, B the plan's batches per full shard (meta ``shard_batches``; an
epoch's last shard may hold fewer, whose indices then go unused), so epoch e starts at
``e * slots * B`` and with ranks the index is the run's, not a rank's. Where the plan
cannot count a shard's batches (B published as 0: a Filter, a chain without an exact
cut) the index numbers slots: every batch of slot G has index G.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchq.errors import ConfigError

__all__ = [
    "EVEN_MODES",
    "BatchNumbering",
    "RankLayout",
    "batch_index",
    "frame_index",
    "lookahead_batches",
    "rank_field",
    "shard_of_slot",
    "slots_for",
]

EVEN_MODES = ("pad", "drop")


def slots_for(shards: int, world: int, even: str) -> int:
    """Slots per epoch for S shards among ``world`` ranks (see the module docstring).

    Raises:
        ConfigError: with 'drop', fewer shards than ranks (every share would be empty).
    """
    if world == 1:
        return shards
    if even == "pad":
        return world * -(-shards // world)
    slots = world * (shards // world)
    if slots == 0:
        raise ConfigError(
            f"even_batches='drop' with {shards} shards per epoch and world_size {world}: "
            "every rank's share would be empty; expected at least one shard per rank"
        )
    return slots


def shard_of_slot(slot: int, shards: int) -> int:
    """The plan's shard that slot ``slot`` builds: itself, or for a pad (slot >= S) one of
    the epoch's first shards."""
    return slot if slot < shards else (slot - shards) % shards


def rank_field(name: str, rank: int, world: int) -> str:
    """The meta field ``name`` of one rank: ``name`` itself for world 1, else
    ``name:<rank>``."""
    return name if world == 1 else f"{name}:{rank}"


@dataclass(frozen=True)
class RankLayout:
    """One run's split among ranks.

    Attributes:
        shards: S, shards per epoch of the plan.
        world: the number of ranks.
        even: 'pad' or 'drop'.
    """

    shards: int
    world: int = 1
    even: str = "pad"

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ConfigError(f"world_size {self.world!r} is not valid: expected an integer >= 1")
        if self.even not in EVEN_MODES:
            raise ConfigError(f"even_batches {self.even!r} is not valid: 'pad' or 'drop'")

    @property
    def slots(self) -> int:
        """Slots per epoch."""
        return slots_for(self.shards, self.world, self.even)

    @property
    def per_rank(self) -> int:
        """P: local shards per epoch of every rank."""
        return self.slots // self.world

    @property
    def pads(self) -> int:
        """Slots per epoch that rebuild an earlier shard (pad mode), for every rank
        together."""
        return max(0, self.slots - self.shards)

    def split(self, g: int) -> tuple[int, int, int]:
        """A global slot number's (epoch, slot, rank)."""
        epoch, slot = divmod(g, self.slots)
        return epoch, slot, slot % self.world

    def shard_of(self, slot: int) -> int:
        """The plan's shard that slot ``slot`` builds (a pad rebuilds an early one)."""
        return shard_of_slot(slot, self.shards)

    def local(self, slot: int, rank: int) -> int | None:
        """Rank ``rank``'s local shard for a slot, or None if the slot is not its own."""
        if not 0 <= slot < self.slots or slot % self.world != rank:
            return None
        return slot // self.world

    def slot(self, local: int, rank: int) -> int:
        """The slot of rank ``rank``'s local shard ``local``."""
        return local * self.world + rank

    def shard_counts(self, shard_batches: int, epoch_batches: int) -> list[int] | None:
        """Each shard's batches in an epoch of the plan, where the plan counts them (B =
        ``shard_batches`` each, the last shard holding E - (S - 1) x B, 1 to B); None
        where it cannot (B unknown, a Filter: E not of that form)."""
        last = epoch_batches - (self.shards - 1) * shard_batches
        if shard_batches <= 0 or not 0 < last <= shard_batches:
            return None
        return [shard_batches] * (self.shards - 1) + [last]

    def slot_batches(self, shard_batches: int, epoch_batches: int) -> list[list[int]] | None:
        """Each rank's local shards' batches in an epoch of the plan, where the plan counts
        them (:meth:`shard_counts`; a pad slot holds its shard's count), else None."""
        counts = self.shard_counts(shard_batches, epoch_batches)
        if counts is None:
            return None
        return [
            [counts[self.shard_of(self.slot(j, r))] for j in range(self.per_rank)]
            for r in range(self.world)
        ]

    def epoch_count(self, shares: list[list[int]]) -> int:
        """The batches every rank yields per epoch, its ``shares`` evened: the most any
        rank holds ('pad'), or the fewest ('drop')."""
        totals = [sum(share) for share in shares]
        return max(totals) if self.even == "pad" else min(totals)

    def to_global(self, n: int, rank: int) -> int:
        """The global slot number of rank ``rank``'s n-th local shard (epoch * P + j)."""
        epoch, j = divmod(n, self.per_rank)
        return epoch * self.slots + self.slot(j, rank)


def batch_index(g: int, k: int, stride: int) -> int:
    """The global batch index of batch ``k`` of global slot ``g`` (see the module
    docstring): ``g * stride + k``, or ``g`` where ``stride`` is 0 (unknown)."""
    return g * stride + k if stride > 0 else g


def frame_index(g: int, k: int, stride: int) -> int:
    """The index whose params a frame of slot ``g`` at ``k`` was built with: a batch's
    own; an END or ERROR frame at ``k`` (no batch, or the one that failed) counts as
    the shard's batch ``min(k, stride - 1)``, so a shard's end never falls on the next
    shard's index."""
    return batch_index(g, min(k, stride - 1) if stride > 0 else k, stride)


def lookahead_batches(window: int, stride: int, world: int) -> int:
    """D, the run's look-ahead in global batch indices: how far past a trainer's
    position (:meth:`BatchNumbering.position`) a producer can have built anything.

    Producers mint a rank's shard only below its published floor plus the window W
    (lease.lua), and the published floor is at most W shards past the shard the
    trainer hands out (:meth:`consumer.reader.ledger.Ledger.window_base`), so a single
    trainer's producers never reach 2 W shards past its position: ``2 W B``. With
    ranks, 2 W local shards of each rank are ``2 W world`` slots; one more round of
    local shards covers ranks one shard ahead of the caller (ranks in step):
    ``(2 W + 1) world B``. B is 1 where the plan numbers slots (stride 0). It depends on
    the plan only, never on timing.
    """
    per_slot = stride if stride > 0 else 1
    if world == 1:
        return 2 * window * per_slot
    return (2 * window + 1) * world * per_slot


@dataclass(frozen=True)
class BatchNumbering:
    """One run's global batch indices (see the module docstring).

    Attributes:
        layout: the run's split among ranks.
        stride: B, batches per full shard; 0 where the plan cannot count them.
        window: W, the producers' look-ahead in (a rank's local) shards.
    """

    layout: RankLayout
    stride: int
    window: int

    def index(self, g: int, k: int) -> int:
        """The index of batch ``k`` of global slot ``g``."""
        return batch_index(g, k, self.stride)

    def local_index(self, local: int, k: int, rank: int) -> int:
        """The index of batch ``k`` of rank ``rank``'s local shard ``local``."""
        return self.index(self.layout.to_global(local, rank), k)

    def epoch_first(self, epoch: int) -> int:
        """The index of epoch ``epoch``'s first batch."""
        return self.index(epoch * self.layout.slots, 0)

    def position(self, local: int, k: int) -> int:
        """The run's position of a trainer that has handed out every shard before its
        local shard ``local`` and the first ``k`` batches of that one: the smallest index
        from which no trainer in step with it has handed anything out.

        World 1: the index of its next batch (with stride 0, of its next slot). Ranks:
        the first index of the next round of local shards (rank 0's slot of ``local``,
        or of ``local + 1`` once ``k`` batches of it were handed out), the same on every
        rank at the same step.
        """
        if self.layout.world == 1 and self.stride > 0:
            return self.index(local, k)
        first = local + (1 if k else 0)
        return self.index(self.layout.to_global(first, 0), 0)

    @property
    def lookahead(self) -> int:
        """D (:func:`lookahead_batches`)."""
        return lookahead_batches(self.window, self.stride, self.layout.world)
