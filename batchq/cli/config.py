"""One configuration story: every option of every command has an environment variable.

``--hwm`` of any command reads ``BATCHQ_HWM``, ``--heartbeat-ttl-s`` reads
``BATCHQ_HEARTBEAT_TTL_S``, ``--url`` reads ``BATCHQ_URL``: the variable is ``BATCHQ_``
plus the option's name in upper case with dashes as underscores. A flag on the command
line wins over the variable, the variable over the built-in default. ``batchq config``
prints the effective settings (and where each came from) with secrets masked. The
command's parser is a :class:`Parser`, which remembers every option added to it for
both (argparse itself lists them only in private attributes).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from batchq.cli.factory_args import shown
from batchq.client.connection import describe_url
from batchq.errors import ConfigError
from batchq.monitoring.text import columns

__all__ = ["Parser", "apply_environment", "env_name", "run_config", "settings"]

PREFIX = "BATCHQ_"
# Options that are not settings (help, positional arguments, --json output switches).
_SKIP = {"help", "json", "yes"}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that keeps what was added to it, for the environment and
    ``batchq config`` (argparse itself lists them only in private attributes).

    Attributes:
        options: every action added with an option string, in order.
        commands: the subcommands' parsers, by name (their class is this one too).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before argparse's own __init__, which adds --help through add_argument.
        self.options: list[argparse.Action] = []
        self.commands: dict[str, Parser] = {}
        self.appending: set[str] = set()  # dests of action="append" (lists of values)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's; the action is remembered when it has option strings."""
        action = super().add_argument(*args, **kwargs)
        if action.option_strings:
            self.options.append(action)
        if kwargs.get("action") == "append":
            self.appending.add(action.dest)
        return action

    def add_command(self, sub: Any, name: str, **kwargs: Any) -> Parser:
        """``sub.add_parser(name, **kwargs)`` (``sub`` from ``add_subparsers``), remembered."""
        parser = sub.add_parser(name, **kwargs)
        if not isinstance(parser, Parser):  # pragma: no cover - parser_class is ours
            raise TypeError(f"subcommand {name!r} got a {type(parser).__name__}")
        self.commands[name] = parser
        return parser


def env_name(option: str) -> str:
    """``--heartbeat-ttl-s`` -> ``BATCHQ_HEARTBEAT_TTL_S``."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = parser.options if isinstance(parser, Parser) else []
    return [a for a in actions if a.dest not in _SKIP]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(parser.commands) if isinstance(parser, Parser) else {}


def _flag(name: str, raw: str) -> bool:
    """A store_true option's variable: 1/true/yes/on or 0/false/no/off (or empty)."""
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r} is not valid: expected 1/0, true/false, yes/no")


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> Any:
    if action.nargs == 0 and action.const is True:  # store_true
        return _flag(name, raw)
    if isinstance(parser, Parser) and action.dest in parser.appending:
        return [p for p in raw.split(",") if p]
    convert = action.type if callable(action.type) else str
    try:
        return convert(raw)
    except argparse.ArgumentTypeError as e:  # its message: "<raw!r> is not valid: expected ..."
        raise ConfigError(f"{name}={e}") from e
    except (TypeError, ValueError) as e:
        kind = getattr(convert, "__name__", "value")
        raise ConfigError(f"{name}={raw!r} is not valid: expected {kind}") from e


def apply_environment(parser: argparse.ArgumentParser) -> None:
    """Make every option of every command default to its environment variable.

    Raises:
        ConfigError: a variable's value does not convert to the option's type.
    """
    for sub in [parser, *_subparsers(parser).values()]:
        for action in _options(sub):
            name = env_name(action.option_strings[-1])
            raw = os.environ.get(name)
            if raw is not None:
                action.default = _convert(sub, action, name, raw)
                action.required = False


def _shown(dest: str, value: Any) -> Any:
    if isinstance(value, dict):  # serve --arg: the factory's keyword arguments
        return shown(value, ("password", "secret", "token", "key"))
    if isinstance(value, str) and dest == "url":
        return describe_url(value)
    if isinstance(value, str) and any(w in dest for w in ("password", "secret", "token")):
        return "***"
    return value


def _setting(
    command: str, action: argparse.Action, args: argparse.Namespace | None
) -> dict[str, Any]:
    """One row of :func:`settings`; ``args``: the parsed command line, for the options
    of ``batchq`` itself (given before the command, so before ``config`` too)."""
    option = action.option_strings[-1]
    name = env_name(option)
    source = "environment" if name in os.environ else "default"
    value = action.default
    if args is not None and getattr(args, action.dest, value) != value:
        value, source = getattr(args, action.dest), "command line"
    return {
        "command": command,
        "option": option,
        "variable": name,
        "value": _shown(action.dest, value),
        "source": source,
        "help": (action.help or "").replace("%%", "%"),
    }


def settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace | None = None
) -> list[dict[str, Any]]:
    """Every setting: command, option, variable, effective value and its source.

    The options of ``batchq`` itself (``--log-level``), which every command reads, come
    first, with the command ``batchq``; then each command's, by command.

    Args:
        parser: the ``batchq`` parser (:class:`Parser`), the environment applied.
        args: the parsed command line of ``batchq config``: an option of ``batchq``
            itself given there shows its value, from the "command line".
    """
    rows = [_setting(parser.prog, action, args) for action in _options(parser)]
    for command, sub in sorted(_subparsers(parser).items()):
        if command == "config":
            continue
        rows.extend(_setting(command, action, None) for action in _options(sub))
    return rows


def run_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the effective configuration, as a table or JSON."""
    rows = settings(parser, args)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    headers = ("COMMAND", "OPTION", "VARIABLE", "VALUE", "SOURCE")
    table = [headers] + [
        (r["command"], r["option"], r["variable"], str(r["value"]), r["source"]) for r in rows
    ]
    print("\n".join(columns(table)))
    return 0
