"""Transformers: streams that wrap streams (``fuel.transformers``).

Finding the root streams of a chain (for sharding): every transformer keeps the stream
it wraps in ``.data_stream``; :class:`Merge` keeps its streams in ``.data_streams``.
Walk these down to the :class:`~producer.streams.DataStream` objects. Random
transformers (:class:`RandomFixedSizeCrop`, :class:`Random2DRotation`, and any class
using :class:`RandomStateMixin`) have ``reseed(seed)``. :func:`cached_mapping` caches a
per-example deterministic ``Mapping`` on disk (:mod:`producer.transformers.cached`).
"""

from __future__ import annotations

from producer.transformers.base import (
    AgnosticSourcewiseTransformer,
    AgnosticTransformer,
    ExpectsAxisLabels,
    RandomStateMixin,
    SourcewiseTransformer,
    Transformer,
    check_sources,
    stack_examples,
)
from producer.transformers.batching import Batch, Cache, Merge, Padding, Unpack
from producer.transformers.cached import CachedMapping, cached_mapping
from producer.transformers.defaults import ToBytes
from producer.transformers.image import (
    MinimumImageDimensions,
    Random2DRotation,
    RandomFixedSizeCrop,
)
from producer.transformers.simple import (
    FLOATX,
    Cast,
    Filter,
    FilterSources,
    Flatten,
    ForceFloatX,
    Mapping,
    Rename,
    ScaleAndShift,
    SortMapping,
)

__all__ = [
    "FLOATX",
    "AgnosticSourcewiseTransformer",
    "AgnosticTransformer",
    "Batch",
    "Cache",
    "CachedMapping",
    "Cast",
    "ExpectsAxisLabels",
    "Filter",
    "FilterSources",
    "Flatten",
    "ForceFloatX",
    "Mapping",
    "Merge",
    "MinimumImageDimensions",
    "Padding",
    "Random2DRotation",
    "RandomFixedSizeCrop",
    "RandomStateMixin",
    "Rename",
    "ScaleAndShift",
    "SortMapping",
    "SourcewiseTransformer",
    "ToBytes",
    "Transformer",
    "Unpack",
    "cached_mapping",
    "check_sources",
    "stack_examples",
]
