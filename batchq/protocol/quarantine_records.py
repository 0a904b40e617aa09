"""Reading a run's quarantined examples (the quarantine hash quarantine.lua writes: see
:mod:`batchq.protocol.keys` and :func:`batchq.protocol.layout.quarantine_record`).

``batchq dead`` lists them, ``status`` rows and ``stream.stats`` count them, a producer
names them when ``max_quarantined`` is passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import parse_quarantine_record
from batchq.protocol.words import as_int, as_text

__all__ = ["Quarantine", "read_quarantine"]


@dataclass
class Quarantine:
    """The quarantine hash of a queue: the run it is for, how many examples that run
    quarantined (exact while the records fit), and the records (by index)."""

    run: str = ""
    count: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def count_of(self, run: str) -> int:
        """The count for ``run`` (0 where the hash is another run's)."""
        return self.count if run and run == self.run else 0


def read_quarantine(client: redis.Redis, keys: QueueKeys, *, records: bool = True) -> Quarantine:
    """The queue's quarantine hash (one HGETALL, bounded by QUARANTINE_CAP records; with
    ``records=False`` two fields only). Records that do not parse are left out."""
    if not records:
        run, count = client.hmget(keys.quarantine, ["run", "count"])
        return Quarantine(as_text(run) if run else "", as_int(count))
    raw_fields: dict[Any, Any] = client.hgetall(keys.quarantine)
    fields = {as_text(k): v for k, v in raw_fields.items()}
    out = Quarantine(as_text(fields.get("run", "")), as_int(fields.get("count")))
    for name, raw in fields.items():
        if name.startswith("i:"):
            try:
                out.records.append(parse_quarantine_record(raw))
            except ValueError:
                continue  # not a record this version writes
    out.records.sort(key=lambda r: (r["epoch"], r["index"]))
    return out
