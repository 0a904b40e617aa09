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
"""

from __future__ import annotations

from dataclasses import dataclass

from batchq.errors import ConfigError

__all__ = ["EVEN_MODES", "RankLayout", "rank_field", "shard_of_slot", "slots_for"]

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

    def to_global(self, n: int, rank: int) -> int:
        """The global slot number of rank ``rank``'s n-th local shard (epoch * P + j)."""
        epoch, j = divmod(n, self.per_rank)
        return epoch * self.slots + self.slot(j, rank)
