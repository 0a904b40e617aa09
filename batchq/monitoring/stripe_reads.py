"""Where a queue lives and, for a striped one, each stripe: read beside its snapshot.

A queue of N stripes (:mod:`batchq.protocol.stripes`) is N queues, on a cluster each on a
master of its own. Its status row is stripe 0's (the queue itself: the trainer's figures,
the producers, the run) plus ``stripes``: per stripe its queue name, the node that holds
it, its depth (every rank's list), frames pushed and popped, and producers alive there.
:func:`read_stripes` reads them, one pipeline per master (:func:`batchq.client.cluster.
grouped`); ``node`` is where the client that read it is bound: a cluster master's
``host:port``, a Sentinel master, or the one server's address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from batchq.client.cluster import grouped
from batchq.client.connection import server_of
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import MetaField, StatsField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import as_int

__all__ = ["StripeSnapshot", "read_stripes", "stripe_count"]


@dataclass
class StripeSnapshot:
    """One stripe of a queue as read (stripe 0: the queue itself)."""

    stripe: int
    queue: str
    node: str
    depth: int
    pushed: int
    popped: int
    producers_alive: int

    def row(self) -> dict[str, Any]:
        """As a status row's ``stripes`` entry."""
        return dict(vars(self))


def stripe_count(meta: dict[str, str]) -> int:
    """The stripes a queue's meta says its run has (1: not striped)."""
    return max(1, as_int(meta.get(MetaField.STRIPES) or 1))


def read_stripes(
    client: redis.Redis, queue: str, count: int, world: int, now_ms: int
) -> list[StripeSnapshot]:
    """Every stripe of ``queue`` striped ``count`` ways (stripe 0 too), in order."""
    keys = {str(k): QueueKeys(queue).stripe(k, count) for k in range(count)}
    out: dict[str, StripeSnapshot] = {}
    with grouped(client, {name: k.meta for name, k in keys.items()}) as groups:
        for node_client, names in groups:
            node = server_of(node_client)

            def reads(pipe: Any, names: list[str] = names) -> None:
                for name in names:
                    k = keys[name]
                    for data in k.rank_data(world) or [k.data]:
                        pipe.llen(data)
                    pipe.hmget(k.stats, [StatsField.PUSHED, StatsField.POPPED])
                    pipe.zcount(k.producers, now_ms, "+inf")

            replies = iter(execute_pipeline(node_client, reads))
            for name in names:
                lists = len(keys[name].rank_data(world)) or 1
                depth = sum(int(next(replies)) for _ in range(lists))
                pushed, popped = next(replies)
                out[name] = StripeSnapshot(
                    int(name), keys[name].queue, node, depth, as_int(pushed), as_int(popped),
                    int(next(replies)),
                )  # fmt: skip
    return [out[str(k)] for k in range(count)]
