"""A Producer's arguments checked before anything connects: each invalid one named with
what was expected (a ConfigError).
"""

from __future__ import annotations

from typing import Any

from batchq.errors import ConfigError

__all__ = ["check_options", "require"]


def check_options(
    hwm: Any, window: Any, heartbeat_ttl_s: float, max_attempts: Any, orphan_exit_s: float | None
) -> None:
    """Refuse a Producer argument that cannot work, naming it and what was expected.

    Raises:
        ConfigError: the first invalid argument.
    """
    require(_is_count(hwm), "hwm", hwm, "an integer >= 1")
    require(window is None or _is_count(window), "window", window, "an integer >= 1")
    require(heartbeat_ttl_s > 0, "heartbeat_ttl_s", heartbeat_ttl_s, "> 0")
    require(_is_count(max_attempts), "max_attempts", max_attempts, ">= 1")
    require(orphan_exit_s is None or orphan_exit_s > 0, "orphan_exit_s", orphan_exit_s, "> 0")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and value >= 1


def require(valid: bool, name: str, value: Any, expected: str) -> None:
    """Raise a ConfigError naming ``name``, ``value`` and what was expected, unless valid."""
    if not valid:
        raise ConfigError(f"{name} {value!r} is not valid: expected {expected}")
