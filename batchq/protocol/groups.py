"""A run read by several groups: every group reads every batch, built once.

A *group* (``ServerDataStream(group='trial-3')``) is one reader of the run with its own
data list(s), claim, floor, cursor, ledger, counters and figures: a trial of a
hyperparameter sweep. The default group (no ``group``) is the single trainer of before.

- **Slots.** Each group of a run has a *slot* 0..:data:`MAX_GROUPS` - 1, given at its
  first claim (the registry hash ``groups``: name -> slot, ``''`` for the default group;
  meta ``groups``: how many slots). Slot 0 is the first group that claimed the run and
  keeps the plain key and field names, so a run of one group is exactly the run of one
  trainer; slot i >= 1 adds ``@<i>`` (:func:`reader_field`,
  :meth:`batchq.protocol.keys.QueueKeys.slot_view`). Slots are never reused in a run.
- **Cursors.** Each (group, rank) has its own cursor ``next`` (its next local shard to
  mint) and floor. A shard is minted once for every group whose cursor is at it (a
  *mask*: bit i for slot i), and its frames go into each of their lists in one push.
  The groups at the largest cursor are the shared stream; one behind it is *detached*
  and its shards are minted for it alone (until its cursor reaches the others').
- **Pace.** The shared stream mints only below ``floor + W`` of every group that paces
  it: every group that has not finished, except one whose ``max_lag_batches`` is set and
  which is more than that many batches behind the leading group (:func:`lag_batches`).
- **World.** Each group reads with its own number of ranks (meta ``world@<i>``,
  ``even@<i>``; slot 0's ``world``, ``even``), fixed while the run has the slot. Only
  groups of one world and S (a *family*) share a shard: a global slot number means
  another slice of the plan in another world. A group that comes back with another
  number of ranks (an elastic resume) reads a new slot, and its old one retires.

The scripts of every run (claim.lua, lease.lua, push.lua, resume.lua, and release.lua)
spell the same rules; a run of one group takes their fast path. Their wrappers are
:mod:`batchq.protocol.trainer_scripts` and :mod:`batchq.protocol.producer_scripts`.
"""

from __future__ import annotations

from batchq.protocol.keys import check_name, slot_suffix
from batchq.protocol.layout import MAX_GROUPS

__all__ = [
    "DEFAULT_GROUP",
    "MAX_GROUPS",
    "check_group",
    "lag_batches",
    "reader_field",
    "slots_of",
]

DEFAULT_GROUP = ""  # the registry's name of the group a stream without ``group`` reads


def check_group(group: str | None) -> str:
    """A stream's ``group`` argument as the registry names it (None: the default group).

    Raises:
        ConfigError: not 1-128 characters from ``[A-Za-z0-9_.-]``.
    """
    return DEFAULT_GROUP if group is None else check_name(group, "group")


def reader_field(name: str, slot: int, rank: int = 0, world: int = 1) -> str:
    """Meta field ``name`` of group slot ``slot``'s rank ``rank`` (per-group fields:
    rank 0 of world 1): ``name``, ``name@<slot>``, ``name:<rank>`` or
    ``name@<slot>:<rank>``."""
    return f"{name}{slot_suffix(slot)}{'' if world == 1 else f':{rank}'}"


def slots_of(mask: int) -> list[int]:
    """The group slots of a mask, ascending."""
    return [i for i in range(MAX_GROUPS) if mask >> i & 1]


def lag_batches(lead_floor: int, floor: int, epoch_batches: int, shards: int) -> float:
    """How many batches a group's floor is behind the leading group's, in the plan's
    batches per shard (epoch_batches / S; 1 where the plan cannot tell)."""
    per_shard = epoch_batches / shards if epoch_batches > 0 and shards > 0 else 1.0
    return max(0, lead_floor - floor) * per_shard
