"""A script call from library code crosses at most three of batchq's modules: the
wrapper's (which builds the call and parses its reply), batchq.protocol.calls (the one
path commands leave by) and batchq.client.redis_internals (the connection and packer).

Each wrapper of tests/batchq/protocol/test_lua_headers.py is run against the real server
(once to load the scripts, then traced): every Python function entered is listed by
file, and the files under batchq/, producer/ and consumer/ are counted.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from batchq.client.connection import make_client
from tests.batchq.protocol.test_lua_headers import WRAPPERS, K

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = tuple(str(ROOT / part) + "/" for part in ("batchq", "producer", "consumer"))
MAX_MODULES = 3


def _modules_entered(run: Any) -> set[str]:
    """The library modules whose code runs below the wrapper ``run`` calls (what the
    test's own lambda computes for the wrapper's arguments, e.g. ``K.rank_data(2)``, is
    the caller's, not the call's)."""
    seen: set[str] = set()
    inside: set[int] = set()  # frames of the call: the wrapper's and all below it

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        caller = frame.f_back
        if (caller is not None and id(caller) in inside) or name.endswith("_scripts.py"):
            inside.add(id(frame))
            if name.startswith(LIBRARY):
                seen.add(str(Path(name).relative_to(ROOT)))

    # A collection during the call would run the finalizers of objects earlier tests in
    # this process left (a stream's shared-memory owners, say) below it: not the call's.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        gc.enable()
    return seen


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_a_script_call_crosses_at_most_three_modules(name: str, redis_url: str) -> None:
    client = make_client(redis_url)
    try:
        WRAPPERS[name](client)  # loads the scripts (NOSCRIPT) and builds the key maps
        modules = _modules_entered(lambda: WRAPPERS[name](client))
    finally:
        stale = client.keys(K.pattern)
        if stale:
            client.delete(*stale)
        client.close()
    assert "batchq/protocol/calls.py" in modules
    assert len(modules) <= MAX_MODULES, sorted(modules)
