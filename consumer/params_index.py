"""Where a ``set_params`` change applies: the trainer's position in the run's global batch
numbering (:class:`batchq.protocol.ranks.BatchNumbering`) and the index a call asks for
(``at_batch``, ``at_epoch``, or the default: the position plus the run's look-ahead D).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchq.errors import ConfigError
from batchq.protocol.ranks import BatchNumbering

__all__ = ["change_index", "positions"]


def positions(
    numbering: BatchNumbering, consumed: tuple[int, Mapping[int, int], list[int]], rank: int
) -> tuple[int, int]:
    """(position, past) of a trainer whose ledger says ``consumed`` (epoch, local shard
    -> batches handed out, local shards handed out completely).

    ``position`` is :meth:`BatchNumbering.position` of its first local shard not handed
    out completely (its next batch in plan order); ``past`` is one more than the largest
    index it handed out (in arrival order it may have handed out batches beyond its
    position; at most ``position`` in plan order).
    """
    epoch, counts, done = consumed
    per_rank = numbering.layout.per_rank
    finished = set(done)
    first = next((s for s in range(per_rank) if s not in finished), per_rank)
    position = numbering.position(epoch * per_rank + first, counts.get(first, 0))
    past = 0
    for shard, n in counts.items():
        if n > 0:
            last = numbering.local_index(epoch * per_rank + shard, n - 1, rank)
            past = max(past, last + 1)
    return position, past


def change_index(
    numbering: BatchNumbering, at_batch: Any, at_epoch: Any, position: int, past: int
) -> int:
    """The index a change applies from: at_batch, at_epoch's first, or the default."""
    if at_batch is not None and at_epoch is not None:
        raise ConfigError(f"at_batch={at_batch!r} and at_epoch={at_epoch!r}: expected at most one")
    for name, value in (("at_batch", at_batch), ("at_epoch", at_epoch)):
        if value is not None and (type(value) is not int or value < 0):
            raise ConfigError(f"{name} {value!r} is not valid: expected an integer >= 0")
    first = max(position, past)
    if at_batch is not None:
        index, what = int(at_batch), f"at_batch {at_batch}"
    elif at_epoch is not None:
        index, what = numbering.epoch_first(at_epoch), f"at_epoch {at_epoch} (batch "
        what += f"{numbering.epoch_first(at_epoch)})"
    else:
        return max(position + numbering.lookahead, past)
    if index < first:
        raise ConfigError(
            f"{what} is in the past: the trainer has handed out batches up to index "
            f"{first - 1}; expected an index >= {first}"
        )
    return index
