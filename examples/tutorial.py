"""The producer side of the docker-compose stack: Fuel's server tutorial as a factory.

``batchq serve examples.tutorial:make_stream`` serves the stream :func:`make_stream`
returns: 1000 examples of 128 features in shuffled batches of 100, behind Fuel's
Bottleneck transformer (a fixed loading delay per batch), the same pipeline as
``batchq demo``. Every producer replica must build the same pipeline, so the sizes come
from environment variables that the compose file sets once for all replicas:

=======================  =======  =================================
variable                 default  meaning
=======================  =======  =================================
``TUTORIAL_EXAMPLES``    1000     examples per epoch
``TUTORIAL_FEATURES``    128      features per example
``TUTORIAL_BATCH_SIZE``  100      examples per batch
``TUTORIAL_LOAD_MS``     5        loading delay per batch (ms)
=======================  =======  =================================

Replace this module with your own: any ``MODULE:FACTORY`` whose factory returns a Fuel
style stream (``producer.streams.DataStream`` or a transformer over one) can be served.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from batchq.cli.demo import Bottleneck
from batchq.errors import ConfigError
from producer.datasets import IndexableDataset
from producer.schemes import ShuffledScheme
from producer.streams import DataStream

__all__ = ["make_stream"]

_ENV = "TUTORIAL_"


def _setting(name: str, default: str, kind: type[int] | type[float], low: float) -> Any:
    """Read ``TUTORIAL_<name>`` as ``kind``, at least ``low``.

    Raises:
        ConfigError: the variable is not a number of that kind, or is below ``low``.
    """
    text = os.environ.get(_ENV + name, default)
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(
            f"{_ENV}{name}={text!r} is not valid: expected {kind.__name__} >= {low:g}"
        ) from None
    if value < low:
        raise ConfigError(f"{_ENV}{name}={text!r} is not valid: expected >= {low:g}")
    return value


def make_stream() -> Any:
    """Fuel's tutorial stream, sized by the ``TUTORIAL_*`` environment variables.

    Returns:
        A Bottleneck over a DataStream of shuffled batches of ``features``.

    Raises:
        ConfigError: a ``TUTORIAL_*`` variable is not a valid number.
    """
    examples = _setting("EXAMPLES", "1000", int, 1)
    features = _setting("FEATURES", "128", int, 1)
    batch_size = _setting("BATCH_SIZE", "100", int, 1)
    load_ms = _setting("LOAD_MS", "5", float, 0)
    stream = DataStream.default_stream(
        # An array, not Fuel's list of lists: served, the lists would arrive as this
        # very array (as from Fuel's server), once numpy converted every int of each batch;
        # in-process they would stay lists.
        IndexableDataset({"features": np.zeros((examples, features), dtype=np.int64)}),
        iteration_scheme=ShuffledScheme(examples=examples, batch_size=batch_size),
    )
    return Bottleneck(stream, slowdown=load_ms / 1000)
