"""The text of batchq's Lua scripts as the tests read it: what a script can run.

``Script.source`` (batchq/protocol/script_files.py) is what is sent: the library
functions of lib/shared.lua the script calls, directly or through another one
(``script_files.library_for``), before the script's own text. A test of what a script
does (the commands it calls, the counters it writes) reads the same.
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


def reachable(name: str) -> str:
    """Script ``name``'s own text, then the text of every library function it calls."""
    own = (LUA_DIR / f"{name}.lua").read_text()
    return "\n".join([own, script_files.library_for(own)])
