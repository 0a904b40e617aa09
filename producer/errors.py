"""Errors raised by the producer-side pipeline (datasets, schemes, streams, transformers).

Every class derives from :class:`batchq.errors.BatchQueueError` and from the builtin
Fuel raises in the same situation, so code ported from Fuel that catches ``ValueError``,
``KeyError`` or ``IndexError`` keeps working.
"""

from __future__ import annotations

from batchq.errors import BatchQueueError, ConfigError

__all__ = [
    "AxisLabelsMismatchError",
    "BatchSizeError",
    "BuildTimeout",
    "ConfigError",
    "ExampleKilled",
    "ImageDimensionsError",
    "IncompleteBatchError",
    "InvalidRequestError",
    "MissingDependencyError",
    "QuarantineExceeded",
    "RequestError",
    "RngError",
    "SchemeError",
    "ShapeError",
    "SourceError",
    "StreamError",
    "StreamMismatchError",
    "UnsupportedInputError",
]


class BatchSizeError(BatchQueueError, ValueError):
    """A batch size is not a positive integer; the message names the value."""


class RequestError(BatchQueueError, IndexError):
    """A request asks for examples outside the dataset; names the index and the size."""


class InvalidRequestError(BatchQueueError, ValueError):
    """A request has the wrong kind: ``None`` where one is needed, or the reverse."""


class SourceError(BatchQueueError, KeyError, ValueError):
    """A source name does not exist; the message names it and lists those that do.

    Fuel raises ``KeyError`` in some places (``Rename``) and ``ValueError`` in others
    (``FilterSources``, ``Dataset(sources=...)``): this class is both.
    """

    def __str__(self) -> str:
        # KeyError's __str__ would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class StreamError(BatchQueueError, ValueError):
    """A stream cannot be built or used as asked (e.g. its kind cannot be inferred)."""


class StreamMismatchError(StreamError):
    """A transformer needs examples and its child gives batches, or the reverse."""


class UnsupportedInputError(StreamMismatchError, NotImplementedError):
    """A transformer got examples (or batches), which it has no method for.

    Fuel raises ``NotImplementedError`` here; this class is that and a
    :class:`StreamMismatchError`.
    """


class SchemeError(BatchQueueError, ValueError):
    """An iteration scheme of the wrong kind was given (e.g. ``Cache`` needs batch sizes)."""


class IncompleteBatchError(BatchQueueError, ValueError):
    """``Batch(strictness=2)`` could not fill a batch of the requested size."""


class ShapeError(BatchQueueError, ValueError):
    """Arrays do not have the shapes a transformer needs; the message gives them."""


class AxisLabelsMismatchError(ShapeError):
    """A source's axis labels are not those a transformer expects (Fuel's error name)."""


class ImageDimensionsError(ShapeError, NotImplementedError):
    """An image has a number of axes a transformer has no method for (Fuel raises
    ``NotImplementedError`` there, e.g. a 4-d example to ``MinimumImageDimensions``)."""


class RngError(BatchQueueError, TypeError):
    """``rng`` is not ``None``, an int seed, a numpy ``Generator`` or ``RandomState``."""


class MissingDependencyError(BatchQueueError, ImportError):
    """An optional dependency (e.g. ``h5py``) is needed and is not installed."""


class QuarantineExceeded(BatchQueueError):
    """More examples of a dataset raised than ``max_quarantined`` allows (or none of the
    substitutes drawn for one could be read); the message names them
    (:mod:`producer.quarantine`)."""


class BuildTimeout(BatchQueueError, TimeoutError):
    """A batch's build took longer than ``build_timeout_s``: the message names the shard
    and, where the stream tells it, the example being read
    (:class:`producer.serving.pushing.BuildWatch`)."""


class ExampleKilled(BatchQueueError):
    """An example's read killed its process (a native crash: SIGSEGV, SIGABRT) or never
    returned, found by reading it first in a forked child (:mod:`producer.isolation`,
    for a shard whose earlier attempt failed); the message names the example and how.
    Raised where the read would have raised: quarantined like an error with
    ``on_sample_error='quarantine'``, else the shard's pipeline error."""
