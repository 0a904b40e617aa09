"""The scripts' replies as typed values, and the one table from a status to an error.

Each ``parse`` takes a script's raw reply (a list whose first element is the status, see
:class:`batchq.protocol.words.Status`) and names its fields; what a status means for the
caller is the caller's (a producer joins again on RUN_CHANGED, a trainer raises), but
when a status is an error, :func:`status_error` is where it becomes one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from batchq.errors import (
    BatchQueueError,
    ProtocolError,
    RunChanged,
    RunFinished,
    StateLost,
    TrainerConflict,
)
from batchq.protocol.words import Status, decode_reply

__all__ = [
    "STATUS_ERRORS",
    "ClaimReply",
    "CountReply",
    "JoinReply",
    "LeaseReply",
    "PopReply",
    "PushReply",
    "RequeueReply",
    "StatusReply",
    "status_error",
]

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


def _int(values: list[Any], i: int, default: int = 0) -> int:
    return int(values[i]) if len(values) > i else default


class StatusReply(NamedTuple):
    """A reply that is only a status (handback, release/refresh of a claim)."""

    status: str

    @classmethod
    def parse(cls, raw: Any) -> StatusReply:
        """From ``{status, ...}``."""
        return cls(decode_reply(raw)[0])


class PushReply(NamedTuple):
    """push.lua: ``{'OK'|'FULL', depth}``, ``{'WRONG_TYPE', key, type}`` or a status."""

    status: str
    depth: int = 0
    key: str = ""
    found: str = ""

    @classmethod
    def parse(cls, raw: Any) -> PushReply:
        """From push.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.WRONG_TYPE:
            return cls(r[0], 0, str(r[1]), str(r[2]))
        return cls(r[0], _int(r, 1))


class LeaseReply(NamedTuple):
    """lease.lua: ``{'OK', g, skip[, slots, world[, shard]], params stamp}`` or a status.

    ``slots`` is 0 in world-1 replies (the plan's S is the caller's); ``params`` is
    meta's params stamp ('<run>:<version>' of the params log, '' for none).
    """

    status: str
    g: int = 0
    skip: int = 0
    slots: int = 0
    world: int = 1
    shard: int | None = None
    params: str = ""

    @classmethod
    def parse(cls, raw: Any) -> LeaseReply:
        """From lease.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] != Status.OK:
            return cls(r[0])
        r, stamp = r[:-1], str(r[-1])  # the stamp ends every OK reply
        shard = int(r[5]) if len(r) > 5 else None
        return cls(r[0], int(r[1]), int(r[2]), _int(r, 3), _int(r, 4, 1), shard, stamp)


class JoinReply(NamedTuple):
    """join.lua: ``{'OK', incarnation, run, hwm, S, window, created[, world]}``,
    ``{'MISMATCH', what, expected}`` or a status."""

    status: str
    incarnation: str = ""
    run: str = ""
    hwm: str = ""
    shards: int = 0
    window: int = 0
    created: bool = False
    world: int = 1
    what: str = ""
    expected: str = ""

    @classmethod
    def parse(cls, raw: Any) -> JoinReply:
        """From join.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.MISMATCH:
            return cls(r[0], what=str(r[1]), expected=str(r[2]))
        if r[0] != Status.OK:
            return cls(r[0])
        return cls(r[0], r[1], r[2], str(r[3]), int(r[4]), int(r[5]), bool(int(r[6])),
                   _int(r, 7, 1))  # fmt: skip


class ClaimReply(NamedTuple):
    """claim.lua. acquire: ``{'OK', incarnation, run, new_run, fence[, held]}``,
    ``{'CONFLICT', ms}``, ``{'WORLD', world}``; the other ops ``{'OK'[, last]}`` or
    ``{'CLAIM_LOST'}``.

    Attributes:
        value: CONFLICT's ms until the other claim lapses, WORLD's world size, or a
            rank's finish: 1 if it was the last rank (else 0; -1 when not said).
    """

    status: str
    incarnation: str = ""
    run: str = ""
    new_run: bool = False
    fence: int = 0
    held: bool = False
    value: int = -1

    @classmethod
    def parse(cls, raw: Any) -> ClaimReply:
        """From claim.lua's raw reply."""
        r = decode_reply(raw)
        if len(r) == 2:  # CONFLICT, WORLD, or finish's {'OK', last}
            return cls(r[0], value=int(r[1]))
        if r[0] != Status.OK or len(r) == 1:
            return cls(r[0])
        return cls(r[0], r[1], r[2], bool(int(r[3])), int(r[4]), bool(_int(r, 5)))


class PopReply(NamedTuple):
    """pop.lua: ``{'OK', producers alive, depth before the pop, {elements}}``,
    ``{'WRONG_TYPE', key, type}`` or a status. Elements stay bytes: they are data."""

    status: str
    alive: int = 0
    depth: int = 0
    elements: list[bytes] = []  # a NamedTuple default, never mutated
    key: str = ""
    found: str = ""

    @classmethod
    def parse(cls, raw: Any) -> PopReply:
        """From pop.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.WRONG_TYPE:
            return cls(r[0], key=str(r[1]), found=str(r[2]))
        if r[0] != Status.OK:
            return cls(r[0])
        return cls(r[0], int(r[1]), int(r[2]), list(r[3]))


class CountReply(NamedTuple):
    """reap.lua and gone.lua: ``{'OK', producers reaped, shards returned}``; fail.lua:
    ``{'RETRY'|'GIVE_UP', attempts}``; resume.lua ``{'OK', run}`` / ``{'STEP', step}``
    (``text``); or a status."""

    status: str
    first: int = 0
    second: int = 0
    text: str = ""

    @classmethod
    def parse(cls, raw: Any) -> CountReply:
        """From the raw reply."""
        r = decode_reply(raw)
        first = int(r[1]) if len(r) > 1 and str(r[1]).lstrip("-").isdigit() else 0
        return cls(r[0], first, _int(r, 2), str(r[1]) if len(r) > 1 else "")


class RequeueReply(NamedTuple):
    """requeue.lua: ``{'OK', requeued shards...}`` or a status."""

    status: str
    requeued: list[int] = []  # a NamedTuple default, never mutated

    @classmethod
    def parse(cls, raw: Any) -> RequeueReply:
        """From requeue.lua's raw reply."""
        r = decode_reply(raw)
        return cls(r[0], [int(g) for g in r[1:]] if r[0] == Status.OK else [])
