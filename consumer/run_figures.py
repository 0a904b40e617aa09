"""What the trainer's ``stream.stats`` shows of the run beyond its own figures: the live
producers' cache figures and the examples the run quarantined.

Producers whose pipeline caches a stage (``producer.torch.cached``) keep hits, misses,
bytes held and build time saved in their pstats counters
(:class:`batchq.protocol.fields.ProducerStat`'s ``CACHE``, set by their heartbeat); the
run's quarantined examples are counted in its quarantine hash
(:mod:`batchq.protocol.quarantine_records`). ``stats`` may be read every batch, so both
are read at most once per :data:`REFRESH_S`: three commands in two round trips.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from batchq.protocol.fields import ProducerStat, producer_stat_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import id_host
from batchq.protocol.quarantine_records import read_quarantine

__all__ = ["REFRESH_S", "RunFigures"]

#: Seconds between two reads of the run's figures.
REFRESH_S = 1.0


class RunFigures:
    """The live producers' cache figures and the run's quarantined count, read at most
    once per :data:`REFRESH_S` (the last ones meanwhile, and on a lost connection: they
    are figures for people)."""

    def __init__(self) -> None:
        self._read_at = -REFRESH_S
        self._cache: dict[str, Any] | None = None
        self._quarantined = 0

    def read(self, client: Any, keys: QueueKeys, run: str) -> tuple[dict[str, Any] | None, int]:
        """(cache, quarantined): ``cache`` is ``{hits, misses, hit_rate, bytes, saved_s,
        producers}`` summed over the producers that cache, ``bytes`` the largest figure
        per host summed over hosts (as ``batchq status``: a host's producers share its
        directory), None when none caches; ``quarantined`` the examples ``run``
        quarantined. None and 0 before the stream connected."""
        now = time.monotonic()
        if client is None or now - self._read_at < REFRESH_S:
            return self._cache, self._quarantined
        self._read_at = now
        try:
            self._quarantined = read_quarantine(client, keys, records=False).count_of(run)
            self._cache = _cache(client, keys)
        except (redis.RedisError, OSError):
            pass
        return self._cache, self._quarantined


def _cache(client: Any, keys: QueueKeys) -> dict[str, Any] | None:
    """The cache figures of the producers in the run's registry (two commands)."""
    listed = client.zrange(keys.producers, 0, -1)
    producers = [p.decode() if isinstance(p, bytes) else str(p) for p in listed]
    fields = [producer_stat_field(p, name) for p in producers for name in ProducerStat.CACHE]
    values = client.hmget(keys.pstats, fields) if fields else []
    n = len(ProducerStat.CACHE)
    rows = [values[i : i + n] for i in range(0, len(values), n)]
    caching = [
        (id_host(p), [int(v) for v in row])
        for p, row in zip(producers, rows, strict=True)
        if all(v is not None for v in row)
    ]
    if not caching:
        return None
    hits = sum(r[0] for _, r in caching)
    misses = sum(r[1] for _, r in caching)
    per_host: dict[str, int] = {}
    for host, r in caching:
        per_host[host] = max(per_host.get(host, 0), r[2])
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "bytes": sum(per_host.values()),
        "saved_s": sum(r[3] for _, r in caching) / 1000,
        "producers": len(caching),
    }
