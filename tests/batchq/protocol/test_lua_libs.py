"""The Lua libraries hold functions only, so that what a script can run is its own text
and the library functions it calls (tests/support/lua_text.py, which the ACL and field
checks read)."""

from __future__ import annotations

import pytest
from lua_text import FUNCTION, lib_text, reachable

from batchq.protocol.calls import SCRIPTS


@pytest.mark.parametrize("name", sorted(lib_text()))
def test_a_library_holds_only_functions_and_comments(name: str) -> None:
    rest = FUNCTION.sub("", lib_text()[name])
    code = [ln for ln in rest.splitlines() if ln.strip() and not ln.lstrip().startswith("--")]
    assert not code, f"lib/{name} has code outside its functions: {code}"


def test_a_script_reaches_the_functions_it_calls_and_those_they_call() -> None:
    push = reachable("push")
    assert "local function count_push(" in push
    assert "local function heartbeat(" in push
    assert "local function reader_sfx(" in push  # the group slots push.lua names
    assert "local function slot_tail(" not in push  # claim.lua and resume.lua call it
    # join.lua calls hand_back_leases, which calls entry_spec.
    assert "local function entry_spec(" in reachable("join")
    pop = reachable("pop")
    assert "local function server_now_ms(" in pop
    assert "local function heartbeat(" not in pop


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_what_a_script_reaches_is_sent_with_it(name: str) -> None:
    source = SCRIPTS[name].source
    for part in reachable(name).split("\nlocal function ")[1:]:
        assert "local function " + part in source
