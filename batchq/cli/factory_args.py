"""The factory ``batchq serve`` calls: ``MODULE:FACTORY`` loaded, and its keyword
arguments, ``--arg key=value``.

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
import importlib
import inspect
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from batchq.errors import ConfigError

__all__ = [
    "ENV_ARGS",
    "FactoryArgsAction",
    "add_factory_args",
    "as_stream",
    "call_factory",
    "load_factory",
    "parse_args_text",
]

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


def load_factory(spec: str) -> Any:
    """Import ``MODULE:FACTORY`` and return the callable.

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported, or it has no
            such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"factory {spec!r} is not valid: expected MODULE:FACTORY")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does: modules of this folder
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"factory {spec!r}: cannot import module {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"factory {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def as_stream(obj: Any) -> Any:
    """The factory's stream; a torch DataLoader becomes one (producer.torch).

    torch is looked for only among the modules already imported: a factory that made
    a DataLoader imported it, and batchq itself never imports torch.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.utils.data.DataLoader):
        from producer.torch import loader_stream

        return loader_stream(obj)
    return obj
