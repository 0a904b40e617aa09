"""Reading a queue's state for people: status rows and their table.

One pipelined round trip per queue; nothing here writes to Redis.

``status --json`` prints a list of objects with these fields (schema version 1):

    queue               str    the queue's name
    run                 str    the run id ('' if none)
    depth               int    LLEN of the data list (items)
    hwm                 int    the run's cap (0 if no producer joined yet)
    producers_alive     int    producers whose heartbeat deadline has not passed
    leases              int    shards leased right now
    shards_per_epoch    int    S (0 if unknown)
    epoch_batches       int    batches per epoch (0 if unknown)
    pushed              int    frames pushed in this run
    popped              int    frames popped in this run
    pushed_bytes        int    bytes pushed in this run
    trainer             str    'attached', 'detached' or 'finished'
    dead                int    frames moved to the dead list
"""

from __future__ import annotations

import json
from typing import Any

import redis

from batchq.keys import QueueKeys, queue_from_meta_key

__all__ = ["STATUS_FIELDS", "list_queues", "queue_status", "render_table"]

STATUS_FIELDS = (
    "queue",
    "run",
    "depth",
    "hwm",
    "producers_alive",
    "leases",
    "shards_per_epoch",
    "epoch_batches",
    "pushed",
    "popped",
    "pushed_bytes",
    "trainer",
    "dead",
)


def list_queues(client: redis.Redis) -> list[str]:
    """The names of every queue on the server (those with a meta hash), sorted."""
    names = set()
    for key in client.scan_iter(match=QueueKeys.META_PATTERN, count=1000):
        name = queue_from_meta_key(key)
        if name is not None:
            names.add(name)
    return sorted(names)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def queue_status(client: redis.Redis, queue: str) -> dict[str, Any]:
    """One queue's status row (see the module docstring for the fields)."""
    keys = QueueKeys(queue)
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.meta)
    pipe.llen(keys.data)
    pipe.zrangebyscore(keys.producers, now_ms, "+inf")
    pipe.hgetall(keys.stats)
    pipe.llen(keys.dead)
    meta_raw, depth, alive, stats_raw, dead = pipe.execute()
    meta = {k.decode(): v.decode() for k, v in meta_raw.items()}
    stats = {k.decode(): _int(v) for k, v in stats_raw.items()}
    leases = 0
    if alive:
        pipe = client.pipeline(transaction=False)
        for p in alive:
            pipe.llen(keys.lease(p.decode()))
        leases = sum(pipe.execute())
    if meta.get("finished") == "1":
        trainer = "finished"
    elif meta.get("claim") and _int(meta.get("claim_deadline")) > now_ms:
        trainer = "attached"
    else:
        trainer = "detached"
    return {
        "queue": queue,
        "run": meta.get("run", ""),
        "depth": int(depth),
        "hwm": _int(meta.get("hwm")),
        "producers_alive": len(alive),
        "leases": leases,
        "shards_per_epoch": _int(meta.get("shards")),
        "epoch_batches": _int(meta.get("epoch_batches")),
        "pushed": stats.get("pushed", 0),
        "popped": stats.get("popped", 0),
        "pushed_bytes": stats.get("pushed_bytes", 0),
        "trainer": trainer,
        "dead": int(dead),
    }


def render_table(rows: list[dict[str, Any]], *, as_json: bool = False) -> str:
    """Render status rows as a readable table, or as JSON."""
    if as_json:
        return json.dumps(rows, indent=2)
    if not rows:
        return "no queues on this server"
    headers = ("QUEUE", "DEPTH/HWM", "PRODUCERS", "LEASES", "SERVED", "TRAINER", "DEAD", "RUN")
    table = [headers]
    for r in rows:
        table.append(
            (
                r["queue"],
                f"{r['depth']}/{r['hwm']}",
                str(r["producers_alive"]),
                str(r["leases"]),
                str(r["pushed"]),
                r["trainer"],
                str(r["dead"]),
                r["run"],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    )
