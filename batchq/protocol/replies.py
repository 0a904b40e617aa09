"""The scripts' replies as typed values, and the one table from a status to an error.

Each reply type is written beside the wrappers of its script (its ``parse`` takes the
script's raw reply, a list whose first element is the status, see
:class:`batchq.protocol.words.Status`, and names its fields), so that a call stays in
the wrapper's module and :mod:`batchq.protocol.calls`; they are all importable from
here. What a status means for the caller is the caller's (a producer joins again on
RUN_CHANGED, a trainer raises), but when a status is an error, :func:`status_error` is
where it becomes one.
"""

from __future__ import annotations

from batchq.errors import (
    BatchQueueError,
    ProtocolError,
    RunChanged,
    RunFinished,
    StateLost,
    TrainerConflict,
)
from batchq.protocol.calls import CountReply, StatusReply
from batchq.protocol.params_scripts import ParamsReply
from batchq.protocol.producer_scripts import JoinReply, LeaseReply, PushReply
from batchq.protocol.recovery_scripts import RequeueReply
from batchq.protocol.trainer_scripts import ClaimReply, PopReply, ReleaseReply, ResumeReply
from batchq.protocol.words import Status

__all__ = [
    "STATUS_ERRORS",
    "ClaimReply",
    "CountReply",
    "JoinReply",
    "LeaseReply",
    "ParamsReply",
    "PopReply",
    "PushReply",
    "ReleaseReply",
    "RequeueReply",
    "ResumeReply",
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
