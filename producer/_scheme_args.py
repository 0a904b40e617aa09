"""The arguments iteration schemes take (:mod:`producer.schemes`): counts, batch sizes,
epochs and Fuel's ``examples`` (a count, or the indices themselves), checked."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from producer.errors import BatchSizeError, ConfigError

__all__ = ["check_batch_size", "check_count", "check_epoch", "check_int", "normalize_examples"]


def check_int(name: str, value: Any, minimum: int = 0, error: type = ConfigError) -> int:
    """``value`` as an int, refused (``error``, naming it) unless an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise error(f"{name}={value!r} is not valid: expected an int >= {minimum}")
    return int(value)


def check_batch_size(batch_size: Any) -> int:
    """A batch size: an int >= 1 (else BatchSizeError)."""
    return check_int("batch_size", batch_size, 1, BatchSizeError)


def check_count(name: str, value: Any) -> int:
    """A count: an int >= 0."""
    return check_int(name, value)


def check_epoch(epoch: Any) -> int:
    """An epoch number: an int >= 0."""
    return check_int("epoch", epoch)


def normalize_examples(examples: Any) -> range | list[int]:
    """Fuel's ``examples``: an int n means ``range(n)``, an iterable lists the indices."""
    if isinstance(examples, numbers.Integral) and not isinstance(examples, bool):
        return range(check_count("examples", examples))
    if isinstance(examples, range):
        return examples
    if not isinstance(examples, Iterable) or isinstance(examples, (str, bytes)):
        raise ConfigError(
            f"examples={examples!r} is not valid: expected an int (the number of "
            "examples) or an iterable of example indices"
        )
    return _example_indices(examples)


def _example_indices(examples: Iterable[Any]) -> list[int]:
    """An iterable of example indices as Python ints (requests stay JSON-able)."""
    indices = examples if isinstance(examples, np.ndarray) else np.asarray(list(examples))
    if indices.size and (indices.ndim != 1 or indices.dtype.kind not in "iu"):
        raise ConfigError(
            f"examples is not valid: expected integer indices, got an array of dtype "
            f"{indices.dtype} and shape {indices.shape}"
        )
    if indices.size and int(indices.min()) < 0:
        raise ConfigError(f"examples contains the negative index {int(indices.min())}")
    return [int(i) for i in indices.tolist()]
