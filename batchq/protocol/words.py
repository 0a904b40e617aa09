"""What the Lua scripts answer: status words, the error a status that ends the caller's
work becomes (:func:`status_error`), and a reply value as text or number (a script's
whole reply is decoded by :func:`batchq.protocol.calls.decode_reply`). What a status
means for the caller is the caller's (a producer joins again on RUN_CHANGED, a trainer
raises), but when a status is an error, :func:`status_error` is where it becomes one."""

from __future__ import annotations

from typing import Any

from batchq.errors import (
    BatchQueueError,
    ProtocolError,
    RunChanged,
    RunFinished,
    StateLost,
    TrainerConflict,
)

__all__ = ["PROTOCOL_VERSION", "STATUS_ERRORS", "Status", "as_int", "as_text", "status_error"]

# Written into meta by whoever creates a run; bump on any incompatible change of the
# key layout, the scripts' replies or the frame header (join.lua refuses a producer of
# another). 2: a frame stored by reference is named by its run (keys.py).
PROTOCOL_VERSION = "2"


class Status:
    """The first element of every script reply."""

    OK = "OK"
    WAIT = "WAIT"
    FULL = "FULL"
    GONE = "GONE"
    EMPTY = "EMPTY"
    MISMATCH = "MISMATCH"
    CONFLICT = "CONFLICT"
    STATE_LOST = "STATE_LOST"
    RUN_CHANGED = "RUN_CHANGED"
    FINISHED = "FINISHED"
    REAPED = "REAPED"
    LEASE_LOST = "LEASE_LOST"
    CLAIM_LOST = "CLAIM_LOST"
    RETRY = "RETRY"
    GIVE_UP = "GIVE_UP"
    WORLD = "WORLD"  # {'WORLD', world}: the run's live ranks use another world size
    STEP = "STEP"  # {'STEP', step}: the job's other ranks resumed from another step
    WRONG_TYPE = "WRONG_TYPE"  # {'WRONG_TYPE', key, type found}: a foreign writer
    REROUTE = "REROUTE"  # push.lua: the rank's trainer is not on the descriptor's host
    # {'GROUPS'[, n]}: the run is read by more groups (n slots) than the call's view of it:
    # call again with the keys of every slot
    GROUPS = "GROUPS"
    DROPPED = "DROPPED"  # push.lua: no list took the frame (finished, or left behind)
    TOO_BIG = "TOO_BIG"  # {'TOO_BIG', bytes}: params.lua, the params log would pass its cap


def as_text(value: Any) -> str:
    """A Redis reply's value as text (bytes decoded as UTF-8)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_int(value: Any) -> int:
    """A Redis reply's value as an int: 0 when it is absent or not a number (a field a
    foreign writer mangled must not break a status read)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


# What a status that ends the caller's work says, and the error it becomes.
STATUS_ERRORS: dict[str, tuple[type[BatchQueueError], str]] = {
    Status.STATE_LOST: (StateLost, "Redis lost the queue's state"),
    Status.RUN_CHANGED: (RunChanged, "the run changed under this trainer"),
    Status.CLAIM_LOST: (TrainerConflict, "this trainer's claim was taken over by another"),
    Status.FINISHED: (RunFinished, "the trainer finished the run"),
}


def status_error(status: str, what: str) -> BatchQueueError:
    """The error a status means, for ``what`` (e.g. "queue q rank 1").

    A status outside :data:`STATUS_ERRORS` is a reply that makes no sense here:
    :class:`ProtocolError`.
    """
    if status in STATUS_ERRORS:
        cls, text = STATUS_ERRORS[status]
        return cls(f"{what}: {text}")
    return ProtocolError(f"{what}: unexpected reply {status!r}")
