"""What a producer builds, as this process builds it by the same shard plan: each batch
as the bytes of its values, for byte-exact comparisons with what a trainer read."""

from __future__ import annotations

from typing import Any

import numpy as np

from producer.serving.sharding import ShardPlan

__all__ = ["Batch", "as_bytes", "built"]

Batch = tuple[bytes, ...]


def as_bytes(batch: Any) -> Batch:
    """A batch's values (arrays or tensors) as bytes."""
    return tuple(np.asarray(v).tobytes() for v in batch)


def built(stream: Any, epochs: int) -> list[list[Batch]]:
    """Every batch of every epoch as this process builds it, shard by shard (bytes)."""
    plan = ShardPlan(stream)
    return [
        [as_bytes(b) for s in range(plan.shards) for b in plan.iter_shard(e, s)]
        for e in range(epochs)
    ]
