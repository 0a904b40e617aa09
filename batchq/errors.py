"""The exceptions of batchq: one root, specific subclasses.

Every error batchq raises derives from :class:`BatchQueueError`. Where Fuel raises a
builtin (``ValueError``, ``TypeError``, ...), the batchq error subclasses both, so
ported code that catches Fuel's errors keeps working. redis-py errors are converted at
the boundary (``raise ConnectionLost(...) from e``).

Groups, to catch a kind of trouble at once:

- :class:`ConfigError` (also ValueError): a value batchq cannot use, e.g.
  :class:`RedisConfigError`, :class:`WorldSizeMismatch` (:class:`GroupWorldMismatch`),
  :class:`StepMismatch`, :class:`TooManyGroups`;
- :class:`RunEnded`: this client's part in the run is over, and it must join or claim
  again (:class:`RunFinished`, :class:`RunChanged`, :class:`StateLost`,
  :class:`TrainerConflict`, :class:`RunGrouped`);
- :class:`ProtocolError`: Redis answered something batchq's scripts never answer (a
  script of another version, a foreign writer);
- :class:`ServerError`: the embedded redis-server cannot be used;
- :class:`StreamStopped`: the stream was closed, or its reader thread stopped.
"""

from __future__ import annotations

from typing import Any


class BatchQueueError(Exception):
    """Root of every error raised by batchq."""


class ConfigError(BatchQueueError, ValueError):
    """A setting or argument has a value batchq cannot use; the message names it."""


class ConnectionLost(BatchQueueError, ConnectionError):
    """Redis could not be reached, or the connection dropped mid-command."""


class FrameError(BatchQueueError, ValueError):
    """A list element failed validation: it is not a frame this version can decode.

    Attributes:
        reason: a short machine-readable reason (``bad_magic``, ``truncated``, ...),
            used as the dead list's reason and the counter's label.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"bad frame ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class ProducerFailed(BatchQueueError):
    """A producer's pipeline raised while building a shard.

    Attributes:
        epoch: the epoch of the failing shard.
        shard: the shard's index inside its epoch.
        producer: the producer's id.
        remote_traceback: the traceback text as the producer formatted it.
    """

    def __init__(
        self, epoch: int, shard: int, producer: str, remote_traceback: str, message: str = ""
    ) -> None:
        text = message or "the producer's pipeline raised"
        super().__init__(
            f"{text} (epoch {epoch}, shard {shard}, producer {producer})\n"
            f"--- remote traceback ---\n{remote_traceback}"
        )
        self.epoch = epoch
        self.shard = shard
        self.producer = producer
        self.remote_traceback = remote_traceback


class ProducersLost(BatchQueueError, TimeoutError):
    """No producer was alive for ``timeout_s`` while the trainer waited for data.

    Attributes:
        epoch: the epoch the trainer was waiting in.
        missing_shards: the shards of that epoch that were not complete.
        timeout_s: how long the trainer waited.
    """

    def __init__(
        self,
        epoch: int,
        missing_shards: list[int],
        timeout_s: float,
        *,
        queue: str = "",
        no_plan: bool = False,
    ) -> None:
        where = f"queue {queue!r}: " if queue else ""
        if no_plan:  # no producer ever joined: most often a queue name or URL that differs
            message = (
                f"{where}no producer published the run's plan within {timeout_s:g} s: none "
                "joined this queue at this Redis (are the producers started, with this "
                "queue's name and URL?)"
            )
        else:
            shown = ", ".join(str(s) for s in missing_shards[:20])
            more = f" (+{len(missing_shards) - 20} more)" if len(missing_shards) > 20 else ""
            message = (
                f"{where}no producer alive for {timeout_s:g} s while waiting for epoch "
                f"{epoch}; missing shards: [{shown}]{more}"
            )
        super().__init__(message)
        self.epoch = epoch
        self.missing_shards = missing_shards
        self.timeout_s = timeout_s


class LengthUnknown(BatchQueueError, TypeError):
    """``len()`` of a stream whose pipeline cannot tell its batches per epoch."""


class RunEnded(BatchQueueError):
    """This client's part in the run is over (finished, replaced, lost or taken)."""


class ProtocolError(BatchQueueError):
    """A script's reply that batchq's scripts never give (another version, a foreign
    writer); the message names the reply."""


class ServerError(BatchQueueError):
    """The embedded redis-server is not running or could not start."""


class StreamStopped(BatchQueueError):
    """A ServerDataStream used after close(), or whose reader thread stopped."""


class TrainerConflict(RunEnded):
    """Another trainer holds the queue's run (its claim is live)."""


class WorldSizeMismatch(ConfigError):
    """A data-parallel rank's world_size differs from the one the run's live ranks use.

    Attributes:
        expected: the run's world size.
        got: this rank's.
    """

    def __init__(self, queue: str, expected: int, got: int) -> None:
        super().__init__(
            f"queue {queue}: world_size {got} does not match the run's live ranks, which "
            f"use world_size {expected}; expected every rank to pass the same world_size"
        )
        self.expected = expected
        self.got = got


class GroupWorldMismatch(WorldSizeMismatch):
    """A group's world_size differs from the one its ranks still reading use. Each group
    of a run reads with its own world size, and a group comes back with another one (an
    elastic resume; it reads a new group slot) once no rank of its old world is live,
    or from a checkpoint of the run.

    Attributes:
        expected: the world size of the group's live ranks.
        got: this trainer's.
    """

    def __init__(self, queue: str, group: str, expected: int, got: int) -> None:
        ConfigError.__init__(
            self,
            f"queue {queue}: group {group or '(default)'} has world_size {got}, but its "
            f"ranks still reading use world_size {expected}; expected every rank of a group "
            "to pass the same world_size (another one resumes the group once its old ranks "
            "stopped, or from a checkpoint with load_state_dict)",
        )
        self.expected = expected
        self.got = got


class TooManyGroups(ConfigError):
    """A run has as many groups as it can (batchq.protocol.layout.MAX_GROUPS)."""


class RankLost(BatchQueueError, TimeoutError):
    """The other ranks of a data-parallel job did not say their batch counts in time.

    Attributes:
        epoch: the epoch being evened.
        ranks: the ranks that stayed silent.
        timeout_s: how long this rank waited.
    """

    def __init__(
        self, epoch: int, ranks: list[int], timeout_s: float, *, empty: int | None = None
    ) -> None:
        if empty is not None:
            message = (
                f"epoch {epoch}: rank {empty} received no batch, so it has nothing to pad "
                "its share with; expected at least one batch per rank and epoch"
            )
        else:
            message = (
                f"epoch {epoch}: ranks {ranks} did not say their batch counts within "
                f"{timeout_s:g} s (stopped, or too far behind)"
            )
        super().__init__(message)
        self.epoch = epoch
        self.ranks = ranks
        self.timeout_s = timeout_s


class StepMismatch(ConfigError):
    """Ranks resumed from states of different steps (not one checkpoint)."""


class PipelineMismatch(BatchQueueError):
    """A producer's pipeline differs from the run's (fingerprint, hwm or shard count), or
    its protocol version does (another batchq version)."""

    def __init__(self, what: str, expected: Any, got: Any) -> None:
        fix = (
            "run one batchq version on every producer and trainer of a run, or reset the queue"
            if what == "version"
            else "start it with the run's pipeline, or reset the queue"
        )
        super().__init__(
            f"pipeline mismatch: the run's {what} is {expected!r}, this producer has {got!r}; "
            + fix
        )
        self.what = what
        self.expected = expected
        self.got = got


class StateLost(RunEnded):
    """Redis lost the queue's state (its incarnation key is gone or changed)."""


class RunFinished(RunEnded):
    """The trainer ended the run with ``close(finished=True)``."""


class RunChanged(RunEnded):
    """The queue moved on to another run; this client's run is over."""


class RunGrouped(RunEnded):
    """The run is read by several groups now: a trainer that claimed it as the only one
    claims, resumes and finishes through the group scripts from here (its session
    handles this; it reaches no caller)."""


class AuthFailed(BatchQueueError, PermissionError):
    """Redis refused the credentials (or the user lacks a permission); never retried.

    Attributes:
        host: the server's host (or socket path).
        port: its port (None for a unix socket).
        user: the user name sent ('default' when none was given).
    """

    def __init__(self, host: str, port: int | None, user: str, detail: str) -> None:
        where = f"{host}:{port}" if port is not None else host
        super().__init__(
            f"Redis at {where} refused user {user!r}: {detail}; check the user and "
            "password in the URL (redis://user:password@host:port/db) or BATCHQ_URL"
        )
        self.host = host
        self.port = port
        self.user = user


class RedisConfigError(ConfigError):
    """The server refused the connection's settings (a database index out of range,
    a protocol it does not speak); never retried. The message names host, port, user."""


class WrongKeyType(BatchQueueError, TypeError):
    """A queue key holds another Redis type than batchq writes there (a foreign writer).

    Attributes:
        key: the key.
        expected: the Redis type batchq expects there ('list', 'string').
        got: the type found.
    """

    def __init__(self, key: str, expected: str, got: str, detail: str = "") -> None:
        super().__init__(
            f"Redis key {key!r} is a {got}, expected a {expected} written by batchq"
            + (f"; {detail}" if detail else "")
        )
        self.key = key
        self.expected = expected
        self.got = got
