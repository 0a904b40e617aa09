"""The keyword arguments a script of one group and its twin for several groups
(:mod:`batchq.protocol.group_scripts`) share, declared once: the lease (lease.lua,
glease.lua), the capped push (push.lua, gpush.lua), the claim (claim.lua, gclaim.lua)
and the resume (resume.lua, gresume.lua).

Each wrapper takes them as ``**shared: Unpack[LeaseArgs]`` (and so on) and passes them
on as they are, beside what only its script takes: their names are the scripts' ARGV
names, so :func:`batchq.protocol.calls.build_call` checks them against the script's
header. Types only: nothing here runs in a call, which crosses the wrapper's module,
``calls`` and the connection alone (tests/batchq/protocol/test_call_path.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict

from batchq.protocol.calls import Arg

__all__ = ["Argv", "ClaimArgs", "ClaimOp", "LeaseArgs", "PushArgs", "ResumeArgs"]

ClaimOp = Literal["acquire", "refresh", "release", "finish"]
#: What a wrapper casts its ``shared`` arguments to before it spreads them into the
#: script's ARGV (every value of these dicts is an Arg; mypy reads a TypedDict's
#: values as ``object``).
Argv = Mapping[str, Arg]


class LeaseArgs(TypedDict):
    """A producer's lease: ``prefetch`` k > 0 rides behind the last push of the shard
    whose lease entry is ``after`` (see :func:`batchq.protocol.scripts.lease_call`)."""

    incarnation: str
    run: str
    producer: str
    token: str
    heartbeat_ttl_ms: int
    prefetch: int
    after: NotRequired[str]


class PushArgs(TypedDict):
    """The capped push of one frame (``last``: the shard's last, sent as a flag):
    ``shm_host``: the element is a shared-memory descriptor of that host ('' for
    none); the ms figures go into the producer's stats."""

    incarnation: str
    run: str
    producer: str
    entry: str
    element: Arg
    last: bool
    heartbeat_ttl_ms: int
    frame_bytes: int
    blocked_ms: int
    produce_ms: int
    shm_host: NotRequired[str]


class ClaimArgs(TypedDict):
    """A trainer's acquire, refresh, release or finish of its claim: ``incarnation`` is
    the queue's incarnation the claim was made in ('' for an acquire; another answers
    STATE_LOST); ``resumed``: the run id the job's ranks resume into."""

    op: ClaimOp
    token: str
    claim_ttl_ms: int
    run_id: str
    new_incarnation: str
    takeover_run: str
    version: str
    rank: int
    world: int
    even: str
    resumed: str
    incarnation: NotRequired[str]


class ResumeArgs(TypedDict):
    """A restart of the plan from a ledger: the new run, the first shard, the plan's
    figures, this rank's place, the checkpoint's step and whether the rank held the run
    before (``held``, sent as a flag)."""

    token: str
    new_run: str
    first: int
    fingerprint: str
    hwm: int | str
    shards: int
    window: int
    epoch_batches: int
    rank: int
    world: int
    even: str
    step: int
    held: bool
