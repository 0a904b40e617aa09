"""The CLI's argument parser: argparse's, remembering what was added to it."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["Parser"]


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
