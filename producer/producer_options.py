"""A Producer's arguments checked before anything connects: each invalid one named with
what was expected (a ConfigError).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from batchq.errors import ConfigError

__all__ = ["check_options", "check_stream", "is_positive", "require"]


def check_options(
    hwm: Any, window: Any, heartbeat_ttl_s: float, max_attempts: Any, orphan_exit_s: float | None
) -> None:
    """Refuse a Producer argument that cannot work, naming it and what was expected.

    Raises:
        ConfigError: the first invalid argument.
    """
    require(_is_count(hwm), "hwm", hwm, "an integer >= 1")
    require(window is None or _is_count(window), "window", window, "an integer >= 1")
    require(is_positive(heartbeat_ttl_s), "heartbeat_ttl_s", heartbeat_ttl_s, "seconds > 0")
    require(_is_count(max_attempts), "max_attempts", max_attempts, "an integer >= 1")
    require(
        orphan_exit_s is None or is_positive(orphan_exit_s), "orphan_exit_s", orphan_exit_s,
        "seconds > 0, or None",
    )  # fmt: skip


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_positive(value: Any) -> bool:
    """A finite number > 0 (not a string of one, not a bool: '10' > 0 raised TypeError)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and 0 < float(value) < math.inf
    )


def require(valid: bool, name: str, value: Any, expected: str) -> None:
    """Raise a ConfigError naming ``name``, ``value`` and what was expected, unless valid."""
    if not valid:
        raise ConfigError(f"{name} {value!r} is not valid: expected {expected}")


def check_stream(stream: Any) -> None:
    """Refuse what is not a stream before anything reads it (a factory that returned
    something else crashed with an AttributeError deep in the shard plan).

    Raises:
        ConfigError: ``stream`` has no ``sources`` or no ``get_epoch_iterator``.
    """
    if hasattr(stream, "sources") and callable(getattr(stream, "get_epoch_iterator", None)):
        return
    raise ConfigError(
        f"data_stream {stream!r:.80} (a {type(stream).__name__}) is not a stream: expected "
        "a DataStream (sources and get_epoch_iterator), a transformer over one, or a torch "
        "DataLoader (batchq serve) or Dataset wrapped by producer.torch.DatasetStream"
    )
