"""Redis Cluster's hash slots: which slot a key is in, and which master owns which slots
(a ``CLUSTER SLOTS`` reply, read once per change of the cluster's layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from redis.crc import key_slot as _crc_slot

__all__ = ["SLOTS", "SlotMap", "key_slot"]


SLOTS: Final = 16384  # Redis Cluster's hash slots


def key_slot(key: str | bytes) -> int:
    """The cluster slot of a key (its hash tag's, if it has one)."""
    return int(_crc_slot(key.encode() if isinstance(key, str) else key))


@dataclass(frozen=True)
class SlotMap:
    """Which master owns which slots: ``(first, last, host, port)`` ranges."""

    ranges: tuple[tuple[int, int, str, int], ...]

    @classmethod
    def from_reply(cls, reply: Any) -> SlotMap:
        """From a ``CLUSTER SLOTS`` reply."""
        ranges = []
        for entry in reply:
            host = entry[2][0]
            host = host.decode() if isinstance(host, bytes) else str(host)
            ranges.append((int(entry[0]), int(entry[1]), host, int(entry[2][1])))
        return cls(tuple(sorted(ranges)))

    def owner(self, slot: int) -> tuple[str, int] | None:
        """The master that owns ``slot``, or None (no master serves it)."""
        for first, last, host, port in self.ranges:
            if first <= slot <= last:
                return host, port
        return None

    def masters(self) -> list[tuple[str, int]]:
        """Every master that owns slots, in slot order, each once."""
        out: list[tuple[str, int]] = []
        for _, _, host, port in self.ranges:
            if (host, port) not in out:
                out.append((host, port))
        return out
