"""One typed function per Lua script: keys from :class:`QueueKeys`, arguments by name,
a typed reply (:mod:`batchq.protocol.replies`).

Each function names every KEYS and ARGV local of its script's header;
:func:`batchq.protocol.calls.build_call` puts them in the header's order and refuses a
name the header does not declare, so a wrapper and its script cannot disagree silently
(tests/batchq/protocol/test_lua_headers.py runs each wrapper against its header). The two
scripts that travel in pipelines (push, lease) are built as a :class:`Call`
(``push_call(...)``, then ``.run(client)`` or ``.queue(pipe)``).

The functions are written by who calls them -- the producer's
(:mod:`batchq.protocol.producer_scripts`: join, lease_call, push_call, fail, handback),
the trainer's (:mod:`batchq.protocol.trainer_scripts`: claim, pop, resume; the params
log's, :mod:`batchq.protocol.params_scripts`: params), work recovery's
(:mod:`batchq.protocol.recovery_scripts`: reap, gone, requeue), and those of a run read
by several groups (:mod:`batchq.protocol.group_scripts`: glease_call, gpush_call, gclaim,
gresume, release_call) -- and used through this module (``scripts.pop(...)``), which
holds them all.
"""

from __future__ import annotations

from batchq.protocol.calls import SCRIPTS, Call, Script, execute_pipeline, load_all
from batchq.protocol.params_scripts import ParamsOp, ParamsReply, Rebuild, params
from batchq.protocol.producer_scripts import (
    fail,
    handback,
    join,
    lease_call,
    push_call,
    quarantine,
)
from batchq.protocol.recovery_scripts import gone, reap, requeue
from batchq.protocol.trainer_scripts import ClaimOp, claim, pop, release_call, resume

__all__ = [
    "SCRIPTS",
    "Call",
    "ClaimOp",
    "ParamsOp",
    "ParamsReply",
    "Rebuild",
    "Script",
    "claim",
    "execute_pipeline",
    "fail",
    "gone",
    "handback",
    "join",
    "lease_call",
    "load_all",
    "params",
    "pop",
    "push_call",
    "quarantine",
    "reap",
    "release_call",
    "requeue",
    "resume",
]
