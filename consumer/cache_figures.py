"""The producers' cache figures in the trainer's ``stream.stats``.

Producers whose pipeline caches a stage (``producer.torch.cached``) keep hits, misses,
bytes held and build time saved in their pstats counters
(:class:`batchq.protocol.fields.ProducerStat`'s ``CACHE``, set by their heartbeat).
The trainer sums those of the producers in the run's registry, reading Redis at most
once per :data:`REFRESH_S` (``stats`` may be read every batch): two commands.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from batchq.protocol.fields import ProducerStat, producer_stat_field
from batchq.protocol.keys import QueueKeys

__all__ = ["REFRESH_S", "CacheFigures"]

#: Seconds between two reads of the producers' counters.
REFRESH_S = 1.0


class CacheFigures:
    """The live producers' cache figures, read at most once per :data:`REFRESH_S`."""

    def __init__(self) -> None:
        self._read_at = -REFRESH_S
        self._last: dict[str, Any] | None = None

    def read(self, client: Any, keys: QueueKeys) -> dict[str, Any] | None:
        """``{hits, misses, hit_rate, bytes, saved_s, producers}`` summed over the
        producers that cache (``bytes``: the largest figure, the directory of one host
        mostly); None when none does or before the stream connected."""
        now = time.monotonic()
        if client is None or now - self._read_at < REFRESH_S:
            return self._last
        self._read_at = now
        try:
            listed = client.zrange(keys.producers, 0, -1)
            producers = [p.decode() if isinstance(p, bytes) else str(p) for p in listed]
            fields = [
                producer_stat_field(p, name) for p in producers for name in ProducerStat.CACHE
            ]
            values = client.hmget(keys.pstats, fields) if fields else []
        except (redis.RedisError, OSError):
            return self._last  # figures for people: a lost connection shows the last ones
        n = len(ProducerStat.CACHE)
        rows = [values[i : i + n] for i in range(0, len(values), n)]
        caching = [[int(v) for v in row] for row in rows if all(v is not None for v in row)]
        if not caching:
            self._last = None
            return None
        hits = sum(r[0] for r in caching)
        misses = sum(r[1] for r in caching)
        self._last = {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes": max(r[2] for r in caching),
            "saved_s": sum(r[3] for r in caching) / 1000,
            "producers": len(caching),
        }
        return self._last
