"""The clock of one blocked push (at the hwm, or at Redis' maxmemory), and when a
data-parallel producer looks whether to hand its shard back (:mod:`producer.serving.blocking`
decides that, :mod:`producer.serving.frame_push` waits).
"""

from __future__ import annotations

import time

__all__ = ["HANDBACK_S", "Waiting"]


# A data-parallel producer blocked this long at a rank's full list looks whether that
# rank's trainer is still alive; if not, the shard goes back to the work list so that
# one stopped rank never holds the producers serving the others.
HANDBACK_S = 1.0


class Waiting:
    """How long one push has been blocked (at the hwm, or at Redis' maxmemory): each
    try reports only its own wait, and a data-parallel producer looks whether to hand
    the shard back once per HANDBACK_S at a full list."""

    def __init__(self) -> None:
        self.since: float | None = None  # blocked since (the last try), or None
        self.full_since = 0.0  # when the hand-back was last looked at

    def start(self) -> bool:
        """Blocked now; False if this is the first time (the clocks just started)."""
        if self.since is None:
            self.since = self.full_since = time.monotonic()
            return False
        return True

    def restart(self) -> None:
        """Still blocked, for another reason: count from now."""
        if self.since is not None:
            self.since = time.monotonic()

    def since_last_try_ms(self) -> int:
        """The wait since the last try (0 before the first block), and restart the count."""
        if self.since is None:
            return 0
        now = time.monotonic()
        waited_ms = int((now - self.since) * 1000)
        self.since = now
        return waited_ms

    def hand_back_due(self) -> bool:
        """True once per HANDBACK_S of being blocked at a full list."""
        if time.monotonic() - self.full_since < HANDBACK_S:
            return False
        self.full_since = time.monotonic()
        return True
