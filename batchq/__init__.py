"""batchq: feed a deep-learning trainer from many data-preparation processes via Redis.

The shared core: the wire codec, the Redis key layout and Lua scripts, connections, the
embedded redis-server, the errors and the CLI. The producer side lives in ``producer``,
the trainer side in ``consumer``.
"""

from batchq.errors import (
    AuthFailed,
    BatchQueueError,
    ConfigError,
    ConnectionLost,
    FrameError,
    GroupWorldMismatch,
    LengthUnknown,
    PipelineMismatch,
    ProducerFailed,
    ProducersLost,
    ProtocolError,
    RankLost,
    RedisConfigError,
    RunChanged,
    RunEnded,
    RunFinished,
    RunGrouped,
    ServerError,
    StateLost,
    StepMismatch,
    StreamStopped,
    TooManyGroups,
    TrainerConflict,
    WorldSizeMismatch,
    WrongKeyType,
)

__version__ = "0.1.0"

__all__ = [
    "AuthFailed",
    "BatchQueueError",
    "ConfigError",
    "ConnectionLost",
    "FrameError",
    "GroupWorldMismatch",
    "LengthUnknown",
    "PipelineMismatch",
    "ProducerFailed",
    "ProducersLost",
    "ProtocolError",
    "RankLost",
    "RedisConfigError",
    "RunChanged",
    "RunEnded",
    "RunFinished",
    "RunGrouped",
    "ServerError",
    "StateLost",
    "StepMismatch",
    "StreamStopped",
    "TooManyGroups",
    "TrainerConflict",
    "WorldSizeMismatch",
    "WrongKeyType",
    "__version__",
]
