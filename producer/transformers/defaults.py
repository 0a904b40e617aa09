"""Fuel's ``fuel.transformers.defaults``: default-transformer recipes and ``ToBytes``.

A dataset's ``default_transformers`` is a tuple of ``(cls, args, kwargs)`` triples that
:meth:`~producer.streams.DataStream.default_stream` applies in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from producer.transformers.base import SourcewiseTransformer
from producer.transformers.simple import Cast, ScaleAndShift

__all__ = ["ToBytes", "uint8_pixels_to_floatX"]


def uint8_pixels_to_floatX(
    which_sources: Sequence[str],
) -> tuple[tuple[type, list[Any], dict[str, Any]], ...]:
    """Scale uint8 pixels to ``[0, 1]`` and cast them to floatX (Fuel's recipe)."""
    return (
        (ScaleAndShift, [1 / 255.0, 0], {"which_sources": which_sources}),
        (Cast, ["floatX"], {"which_sources": which_sources}),
    )


class ToBytes(SourcewiseTransformer):
    """Turns each array example of the selected sources into its raw bytes.

    Used to read variable-length byte data stored as a ragged uint8 array (e.g.
    encoded images). A batch becomes a list of ``bytes``; the axis labels become
    ``('bytes',)`` (``('batch', 'bytes')`` for batches).

    Args:
        stream: the wrapped stream.
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(self, stream: Any, **kwargs: Any) -> None:
        labels = dict(stream.axis_labels or {})
        for source in kwargs.get("which_sources") or stream.sources:
            batched = "batch" in (labels.get(source) or ())
            labels[source] = ("batch", "bytes") if batched else ("bytes",)
        kwargs.setdefault("axis_labels", labels)
        super().__init__(stream, stream.produces_examples, **kwargs)

    def transform_source_example(self, source_example: Any, source_name: str) -> bytes:
        """The example's bytes."""
        return np.asarray(source_example).tobytes()

    def transform_source_batch(self, source_batch: Any, source_name: str) -> list[bytes]:
        """A list of each example's bytes."""
        return [np.asarray(example).tobytes() for example in source_batch]
