"""Keyword arguments for the factory ``batchq serve`` calls: ``--arg key=value``.

``batchq serve mod:make_stream --arg seed=3 --arg size=large`` calls
``make_stream(seed=3, size='large')``. A value is read as JSON when it parses as JSON
(``3``, ``0.5``, ``true``, ``null``, ``[1, 2]``, ``{"a": 1}``, ``"3"`` for the string), and
is the plain string otherwise (``large``). ``BATCHQ_ARGS`` holds the same pairs,
whitespace-separated with shell quoting (``seed=3 size=large``), or one JSON object
(``{"seed": 3, "size": "large"}``); a ``--arg`` on the command line wins over the same
key there. ``batchq config`` shows the effective arguments (keys that look like secrets
masked), and ``--workers`` passes them to each worker in its environment, never on a
command line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from batchq.errors import ConfigError

__all__ = ["ENV_ARGS", "FactoryArgsAction", "add_factory_args", "call_factory", "parse_args_text"]

ENV_ARGS = "BATCHQ_ARGS"
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


# config.py names an option's type in its error message: say what is expected.
parse_args_text.__name__ = "KEY=VALUE pairs or a JSON object"


class FactoryArgsAction(argparse.Action):
    """Each ``--arg`` adds its pairs to a dict that starts from the default (the
    environment's), so that the command line wins key by key."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = dict(getattr(namespace, self.dest, None) or {})
        current.update(values)
        setattr(namespace, self.dest, current)


def add_factory_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--arg KEY=VALUE`` (its variable: ``BATCHQ_ARGS``) to a command."""
    parser.add_argument(
        "--arg",
        "--args",
        dest="factory_args",
        metavar="KEY=VALUE",
        type=parse_args_text,
        action=FactoryArgsAction,
        default={},
        help="a keyword argument for the factory (repeatable; JSON values, else strings)",
    )


def call_factory(factory: Callable[..., Any], spec: str, kwargs: dict[str, Any]) -> Any:
    """Call ``factory(**kwargs)``, refusing arguments it does not take, by name.

    Raises:
        ConfigError: the factory's signature does not accept ``kwargs``.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: just call it
        return factory(**kwargs)
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        names = ", ".join(sorted(kwargs)) or "none"
        raise ConfigError(
            f"factory {spec!r} does not take the arguments given ({names}): {e}; "
            f"its signature is {spec.partition(':')[2]}{signature}"
        ) from None
    return factory(**kwargs)


def shown(value: dict[str, Any], secret_words: Sequence[str]) -> dict[str, Any]:
    """The arguments for display, values of secret-looking keys masked."""
    return {k: "***" if any(w in k.lower() for w in secret_words) else v for k, v in value.items()}
