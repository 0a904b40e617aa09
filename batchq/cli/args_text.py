"""The text of factory arguments, parsed: ``'seed=3 size=large'`` or one JSON object.

A value is read as JSON when it parses as JSON (``3``, ``0.5``, ``true``, ``[1, 2]``,
``"3"`` for the string) and is the plain string otherwise; the pairs are
whitespace-separated with shell quoting. Where the text comes from and how the arguments
reach the factory: :mod:`batchq.cli.factory_args`.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from batchq.errors import ConfigError

__all__ = ["parse_args_text"]


_MAX_TEXT = 64 * 1024  # arguments are settings, not data


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_args_text(text: str) -> dict[str, Any]:
    """``'seed=3 size=large'`` or ``'{"seed": 3}'`` -> ``{'seed': 3, 'size': 'large'}``.

    Raises:
        ConfigError: a pair has no ``=`` or an empty or non-identifier key, the quoting
            is unbalanced, or a JSON object's keys are not identifiers.
    """
    if len(text) > _MAX_TEXT:
        raise ConfigError(f"factory arguments of {len(text)} characters: at most {_MAX_TEXT}")
    stripped = text.strip()
    items = _json_items(text, stripped) if stripped.startswith("{") else _pair_items(text)
    out: dict[str, Any] = {}
    for key, value in items:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(
                f"factory argument name {key!r} is not valid: expected a Python identifier"
            )
        out[key] = value
    return out


def _json_items(text: str, stripped: str) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a JSON object (keys not yet checked)."""
    try:
        pairs = json.loads(stripped)
    except ValueError as e:
        raise ConfigError(f"factory arguments {text[:200]!r} are not a JSON object: {e}") from None
    if not isinstance(pairs, dict):
        raise ConfigError(f"factory arguments {text[:200]!r}: expected a JSON object")
    return list(pairs.items())


def _pair_items(text: str) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of shell-quoted ``KEY=VALUE`` words (keys not yet checked)."""
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"factory arguments {text[:200]!r} are not valid: {e}") from None
    items: list[tuple[Any, Any]] = []
    for token in tokens:
        key, sep, raw = token.partition("=")
        if not sep:
            raise ConfigError(
                f"factory argument {token!r} is not valid: expected KEY=VALUE (e.g. seed=3)"
            )
        items.append((key, _value(raw)))
    return items
