"""The text of batchq's Lua scripts as the tests read it: what a script can run.

``Script.source`` (batchq/protocol/script_files.py) is what is sent: lib/shared.lua
lib/groups.lua) before the script's own text, every library function whether the script
calls it or not. A test of what a script does (the commands it calls, the counters it
writes) reads its own text and the library functions it calls, directly or through
another one.
"""

from __future__ import annotations

import re
from pathlib import Path

from batchq.protocol import script_files

LUA_DIR = Path(script_files.__file__).resolve().parent / "lua"
# A library function: from its `local function name(` line to the `end` that closes it,
# the first one at the start of a line.
FUNCTION = re.compile(r"^local function (\w+)\(.*?^end$", re.M | re.S)


def lib_text() -> dict[str, str]:
    """Each library file's name -> its text."""
    return {path.name: path.read_text() for path in sorted((LUA_DIR / "lib").glob("*.lua"))}


def lib_functions() -> dict[str, str]:
    """Each library function's name -> its text."""
    return {m.group(1): m.group(0) for text in lib_text().values() for m in FUNCTION.finditer(text)}


def _code(text: str) -> str:
    """The text without its comments (a call named in a comment is no call)."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def reachable(name: str) -> str:
    """Script ``name``'s own text, then the text of every library function it calls."""
    functions = lib_functions()
    own = (LUA_DIR / f"{name}.lua").read_text()
    called: set[str] = set()
    todo = [own]
    while todo:
        code = _code(todo.pop())
        for function, body in functions.items():
            if function not in called and re.search(rf"\b{function}\(", code):
                called.add(function)
                todo.append(body)
    return "\n".join([own, *(functions[f] for f in sorted(called))])
