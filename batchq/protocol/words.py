"""What the Lua scripts answer: status words and reply decoding, shared by both sides."""

from __future__ import annotations

from typing import Any

__all__ = ["PROTOCOL_VERSION", "Status", "as_int", "as_text", "decode_reply"]

# Written into meta by whoever creates a run; bump on any incompatible change of the
# key layout, the scripts' replies or the frame header.
PROTOCOL_VERSION = "1"


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
    # {'GROUPS'[, n]}: the run is read by several groups (n slots): the group scripts'
    # (batchq.protocol.group_scripts), with the keys of every slot
    GROUPS = "GROUPS"
    DROPPED = "DROPPED"  # gpush.lua: no list took the frame (finished, or left behind)
    TOO_BIG = "TOO_BIG"  # {'TOO_BIG', bytes}: params.lua, the params log would pass its cap


def decode_reply(reply: Any) -> list[Any]:
    """Decode a script's reply: bytes become str, nested tables stay lists of bytes.

    The elements of a nested list (popped frames) are left as bytes: they are data.
    """
    out: list[Any] = []
    for item in reply:
        if isinstance(item, bytes):
            out.append(item.decode("utf-8", "replace"))
        else:
            out.append(item)
    return out


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
