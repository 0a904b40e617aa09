"""One queue over several Redis slots: how a run's shards are dealt among its stripes.

Written down once, for the producer, the trainer and the monitoring (the scripts need
nothing of it: each stripe is a queue of its own to them).

- A run of queue ``Q`` with N stripes (a producer option fixed when the run is created:
  meta ``stripes``, set by join.lua with the rest of the plan and checked at every join)
  is N queues: stripe 0 is ``Q`` itself, stripe k >= 1 the queue
  :func:`batchq.protocol.keys.stripe_name` ``(Q, k, N)``, whose hash tag puts it in a
  slot of its own (on a cluster, on a master of its own). Each has its own data list and
  cap (the run's hwm), leases, work list, window, counters, claim and run id.
- Shards are dealt round-robin in the trainer's own numbering: its shard ``n``
  (``epoch * P + j``: a single trainer's global shard number, a data-parallel rank's
  local one, :mod:`batchq.protocol.ranks`) belongs to stripe ``n % N``, where it is the
  stripe's shard ``m = n // N``. A stripe counts its ``m`` with the arithmetic of the
  whole run (its ``next``, ``floor``, leases ``<g>:<token>`` with
  ``g = layout.to_global(m, rank)``, ledger fields ``'<epoch>:<slot>'`` of that g), so
  every script runs on a stripe unchanged.
- A producer leases from each stripe in turn and turns a stripe's g back into the plan's
  (:meth:`Stripes.plan_g`): the shard it builds, and the address its frames carry, are
  the plan's.
- The trainer claims every stripe and pops them all into its one ledger, in its own
  terms. What it tells a stripe is translated: its floor (:meth:`Stripes.floor_of`: how
  many of the stripe's shards lie below the trainer's floor), the shards it requeues and
  the ledger pairs it resumes from (:meth:`Stripes.split`). Each stripe mints up to W of
  its own shards past its floor, so the trainer's look-ahead window is N x W.
- A job resumed with another number of ranks (consumer/rank_state.py) re-splits the
  rest of an epoch: each stripe gets its share of the new slots' ledger pairs and of the
  remap (slot -> the plan's shard that slot builds), in its numbers
  (:meth:`Stripes.split_remap`); the shard lease.lua names from the remap is the plan's
  already, built as named.

A queue of one stripe is exactly the queue of before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchq.errors import ConfigError
from batchq.protocol.layout import ledger_field, parse_ledger_field
from batchq.protocol.ranks import RankLayout

__all__ = ["MAX_STRIPES", "RemapShare", "Stripes", "check_stripes"]

MAX_STRIPES = 64  # a trainer runs a reader thread and holds two connections per stripe

#: A stripe's share of an elastic resume: its ledger pairs and its remap (epoch, slot ->
#: the plan's shard), in its numbers (:meth:`Stripes.split_remap`).
RemapShare = tuple[list[tuple[str, str]], tuple[int, dict[int, int]]]


def check_stripes(value: object) -> int:
    """``value`` as a stripe count.

    Raises:
        ConfigError: not an integer in 1..MAX_STRIPES.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STRIPES:
        raise ConfigError(
            f"stripes {value!r} is not valid: expected an integer in 1..{MAX_STRIPES}"
        )
    return value


@dataclass(frozen=True)
class Stripes:
    """How a run's shards are dealt among its ``count`` stripes (see the module)."""

    count: int = 1

    def __post_init__(self) -> None:
        check_stripes(self.count)

    @property
    def striped(self) -> bool:
        """More than one stripe."""
        return self.count > 1

    def of(self, n: int) -> tuple[int, int]:
        """(stripe, the stripe's shard m) of the trainer's shard ``n``."""
        return n % self.count, n // self.count

    def local(self, stripe: int, m: int) -> int:
        """The trainer's shard of stripe ``stripe``'s shard ``m``."""
        return m * self.count + stripe

    def floor_of(self, floor: int, stripe: int) -> int:
        """Stripe ``stripe``'s floor for the trainer's ``floor``: how many of its shards
        lie below it (all of them complete)."""
        return max(0, -(-(floor - stripe) // self.count))

    def below(self, floor: int, stripe: int) -> int:
        """The highest trainer floor whose :meth:`floor_of` is at most stripe
        ``stripe``'s ``floor`` (a floor published to the stripe is stale once the
        trainer's passes this)."""
        return floor * self.count + stripe

    def plan_g(self, g: int, stripe: int, layout: RankLayout) -> int:
        """The plan's global slot number of stripe ``stripe``'s slot number ``g`` (what
        its lease names; ``layout``: the run's split among ranks)."""
        if not self.striped:
            return g
        epoch, slot = divmod(g, layout.slots)
        rank, j = slot % layout.world, slot // layout.world
        return layout.to_global(self.local(stripe, epoch * layout.per_rank + j), rank)

    def stripe_g(self, g: int, layout: RankLayout) -> tuple[int, int]:
        """(stripe, the stripe's slot number) of the plan's global slot number ``g``: the
        inverse of :meth:`plan_g`."""
        epoch, slot = divmod(g, layout.slots)
        stripe, m = self.of(epoch * layout.per_rank + slot // layout.world)
        return stripe, layout.to_global(m, slot % layout.world)

    def split_remap(
        self, pairs: Iterable[tuple[str, str]], remap: tuple[int, dict[int, int]],
        layout: RankLayout,
    ) -> dict[int, RemapShare]:  # fmt: skip
        """An elastic resume's ledger pairs (``'<epoch>:<slot>'`` of the plan's slots) and
        remap (epoch E, slot -> shard) as each stripe's, in its numbers. The trainer's
        epoch E lies whole in each stripe's epoch E // N (its shards n, E * P <= n <
        (E + 1) * P, are the stripe's m = n // N, and m // P = E // N); the N epochs that
        stripe epoch holds use disjoint slots of it, so lease.lua's remap (meta
        ``remap_epoch`` = E // N, the hash holding only E's slots) names E's shards alone."""
        epoch, slots = remap
        out: dict[int, RemapShare] = {k: ([], (epoch // self.count, {})) for k in range(self.count)}
        for field, value in pairs:
            e, slot = parse_ledger_field(field)
            stripe, g = self.stripe_g(e * layout.slots + slot, layout)
            out[stripe][0].append((ledger_field(*divmod(g, layout.slots)), value))
        for slot, shard in slots.items():
            stripe, g = self.stripe_g(epoch * layout.slots + slot, layout)
            out[stripe][1][1][g % layout.slots] = shard
        return out

    def split(
        self, pairs: Iterable[tuple[str, str]], per_epoch: int
    ) -> dict[int, list[tuple[str, str]]]:
        """The trainer's ledger pairs (``'<epoch>:<j>'`` of its own shards, ``per_epoch``
        P of them an epoch) as each stripe's (``'<epoch>:<j>'`` of the stripe's m)."""
        out: dict[int, list[tuple[str, str]]] = {k: [] for k in range(self.count)}
        for field, value in pairs:
            epoch, j = parse_ledger_field(field)
            stripe, m = self.of(epoch * per_epoch + j)
            out[stripe].append((ledger_field(*divmod(m, per_epoch)), value))
        return out

    def shards_of(self, shards: Iterable[int], stripe: int) -> list[int]:
        """Of the trainer's ``shards``, stripe ``stripe``'s, as its m."""
        return [n // self.count for n in shards if n % self.count == stripe]
