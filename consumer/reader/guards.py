"""The reader's guard against a replaced key: a queue key a foreign writer replaced by
another type is waited out (bounded), then :class:`~batchq.errors.WrongKeyType`.

A :class:`KeyGuard` is given what it needs (the queue's name, the bound, the reader's
stop event) and keeps one fact: since when a key has been of the wrong type. The pop
script names such a key in its reply; a reap or requeue script meets one as a Redis
error. Either way the reader waits here, and the next successful pop clears it.
"""

from __future__ import annotations

import logging
import threading
import time

from batchq.errors import WrongKeyType
from batchq.protocol.keys import KEY_TYPES

__all__ = ["WAIT_S", "KeyGuard"]

log = logging.getLogger(__name__)

# How long a replaced key is waited for between checks.
WAIT_S = 0.2


# The Redis type of each key pop.lua checks, by the key's last part.
class KeyGuard:
    """Waits out a replaced queue key, for at most ``timeout_s`` in all.

    Args:
        queue: the queue's name (for messages).
        timeout_s: how long a key may stay of the wrong type.
        halt: the reader's stop event (a wait ends when it is set).
    """

    def __init__(self, queue: str, timeout_s: float, halt: threading.Event) -> None:
        self.queue = queue
        self.timeout_s = timeout_s
        self.halt = halt
        self.since: float | None = None  # since when a key is of the wrong type

    def wrong_type(self, key: str, got: str) -> None:
        """A queue key was replaced by another type: wait for a repair, bounded.

        Raises:
            WrongKeyType: it stayed so for timeout_s.
        """
        now = time.monotonic()
        expected = KEY_TYPES.get(key.rsplit(":", 1)[-1], "type batchq wrote")
        if self.since is None:
            self.since = now
            log.warning(
                "queue %s: %s is a %s, not a %s; waiting up to %g s for it to be repaired",
                self.queue,
                key,
                got,
                expected,
                self.timeout_s,
            )
        if now - self.since > self.timeout_s:
            raise WrongKeyType(key, expected, got, f"for {self.timeout_s:g} s")
        self.halt.wait(WAIT_S)

    def repaired(self) -> None:
        """The keys were of their types again (a pop script went through)."""
        self.since = None
