"""The Lua scripts in ``batchq/protocol/lua``: each read once, with its header and sha.

Each script names its KEYS and ARGV as locals at its top, one per line and in order::

    local meta_key = KEYS[1]         -- HASH   the run's meta
    local run = ARGV[2]
    local heartbeat_ttl_ms = tonumber(ARGV[7])

and says where a variable-length tail starts with a comment ``-- KEYS[7..]: ...`` (or
``ARGV``). :func:`parse_header` reads that header into a :class:`Header`, which
:func:`batchq.protocol.calls.build_call` puts a call's named keys and arguments in the
order of, so no Python code spells a position (tests/batchq/protocol/test_lua_headers.py
calls every wrapper against its script's header). KEYS locals end in ``_key``; the
wrappers name them without that suffix. What several scripts do is written once in
``lua/lib/shared.lua``; each script is sent with the library functions it calls
(:func:`library_for`) before its own text (the sha covers both).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from batchq.errors import ProtocolError

__all__ = [
    "KEY_SUFFIX",
    "SCRIPTS",
    "Arg",
    "Header",
    "Script",
    "library_for",
    "load_all",
    "parse_header",
]

#: A value of a script's KEYS or ARGV (or of any command batchq sends).
Arg = str | bytes | bytearray | memoryview | int | float

_LUA_DIR = Path(__file__).resolve().parent / "lua"
_SHARED = (_LUA_DIR / "lib" / "shared.lua").read_text()
# A library function: from its `local function name(` line to the `end` that closes it,
# the first one at the start of a line (tests/batchq/protocol/test_lua_libs.py: a library
# holds nothing else).
_FUNCTION = re.compile(r"^local function (\w+)\(.*?^end$", re.M | re.S)
_NAMED = re.compile(r"^local (\w+) = (?:tonumber\()?(KEYS|ARGV)\[(\d+)\]")
_TAIL = re.compile(r"^-- (KEYS|ARGV)\[(\d+)\.\.\]:")
_CALL = re.compile(r"\b(\w+)\(")
#: The library's functions by name, in its order.
_LIBRARY = {m.group(1): m.group(0) for m in _FUNCTION.finditer(_SHARED)}
KEY_SUFFIX = "_key"


@dataclass(frozen=True)
class Header:
    """What a script's header declares.

    Attributes:
        keys: the KEYS locals in order, without their ``_key`` suffix.
        args: the ARGV locals in order.
        keys_tail: KEYS continue past the named ones (lease lists, rank lists...).
        args_tail: ARGV continue past the named ones.
    """

    keys: tuple[str, ...]
    args: tuple[str, ...]
    keys_tail: bool
    args_tail: bool


def _code(text: str) -> str:
    """The text without its comments (a call named in a comment is no call)."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def library_for(text: str) -> str:
    """The library functions script ``text`` calls, directly or through another one, in
    the library's order (a function is defined before those that call it)."""
    called: set[str] = set()
    todo = [text]
    while todo:
        # One scan for every call (a search per library function per text was most of
        # this module's import, which every producer and trainer process pays).
        for name in _CALL.findall(_code(todo.pop())):
            if name in _LIBRARY and name not in called:
                called.add(name)
                todo.append(_LIBRARY[name])
    return "".join(f"{body}\n" for name, body in _LIBRARY.items() if name in called)


def parse_header(name: str, source: str) -> Header:
    """Read the KEYS/ARGV locals at the top of a script.

    Raises:
        ProtocolError: the header's indices do not count 1, 2, 3... or a KEYS local
            does not end in ``_key``.
    """
    found: dict[str, list[str]] = {"KEYS": [], "ARGV": []}
    tails: dict[str, int] = {}
    for line in source.splitlines():
        named, tail = _NAMED.match(line), _TAIL.match(line)
        if named:
            local, table, index = named.group(1), named.group(2), int(named.group(3))
            if index != len(found[table]) + 1:
                raise ProtocolError(f"{name}.lua: {local} is {table}[{index}], expected "
                                    f"{table}[{len(found[table]) + 1}]")  # fmt: skip
            if table == "KEYS" and not local.endswith(KEY_SUFFIX):
                raise ProtocolError(f"{name}.lua: KEYS local {local!r} must end in _key")
            found[table].append(local.removesuffix(KEY_SUFFIX) if table == "KEYS" else local)
        elif tail:
            tails[tail.group(1)] = int(tail.group(2))
    for table, start in tails.items():
        if start != len(found[table]) + 1:
            raise ProtocolError(f"{name}.lua: its {table} tail starts at {start}, expected "
                                f"{len(found[table]) + 1}")  # fmt: skip
    return Header(tuple(found["KEYS"]), tuple(found["ARGV"]), "KEYS" in tails, "ARGV" in tails)


class Script:
    """One Lua script of ``batchq/lua``.

    Args:
        name: the file name without ``.lua``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Next to this module, not resources.files("batchq"): run from a folder holding a
        # checkout named batchq, "batchq" is a namespace package over both, whose
        # MultiplexedPath cannot join two parts (TypeError) and may pick the wrong one.
        text = (_LUA_DIR / f"{name}.lua").read_text()
        self.header = parse_header(name, text)
        # What several scripts do is written once, in lib/shared.lua; each script is sent
        # with the library functions it calls (a script defines every function it is
        # sent with on each call).
        self.source = library_for(text) + text
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Add an EVALSHA of this script to a pipeline (see
        :func:`batchq.protocol.calls.execute_pipeline`)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


SCRIPTS: dict[str, Script] = {
    name: Script(name)
    for name in (
        "claim",
        "detach",
        "handback",
        "join",
        "lease",
        "params",
        "pop",
        "push",
        "quarantine",
        "reap",
        "release",
        "requeue",
        "resume",
    )
}


def load_all(client: redis.Redis) -> None:
    """Load every script into the server's script cache."""
    for script in SCRIPTS.values():
        client.script_load(script.source)
