"""The params log's script (params.lua), its typed wrapper and its reply, together (see
:mod:`batchq.protocol.calls`).

The trainer calls it: ``add`` (a ``set_params`` call), ``load`` (a checkpoint's log for
the run a resume is about to create) and ``rebuild`` (shards whose batches were built
with params since changed, back to the work list).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import redis

from batchq.protocol.calls import Arg, build_call, decode_reply
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES
from batchq.protocol.words import Status, as_text

__all__ = ["ParamsOp", "ParamsReply", "Rebuild", "params"]

ParamsOp = Literal["add", "load", "rebuild"]


class Rebuild(NamedTuple):
    """One shard to build again: its ledger field (its epoch and slot,
    :func:`batchq.protocol.layout.ledger_field`), the batches the trainer keeps of it (a
    prefix), and its global slot number."""

    field: str
    kept: int
    g: int


class ParamsReply(NamedTuple):
    """params.lua: ``{'OK', version, log JSON}`` (add, load), ``{'OK'}`` (rebuild),
    ``{'TOO_BIG', bytes}`` or a status.

    Attributes:
        version: the stored log's version (its entries).
        log: the stored log's JSON, ``{"run", "entries"}`` ('' for none).
        size: TOO_BIG's bytes.
    """

    status: str
    version: int = 0
    log: str = ""
    size: int = 0

    @classmethod
    def parse(cls, raw: Any) -> ParamsReply:
        """From params.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.TOO_BIG:
            return cls(r[0], size=int(r[1]))
        if r[0] != Status.OK or len(r) < 3:
            return cls(r[0])
        return cls(r[0], int(r[1]), as_text(r[2]))


def params(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    op: ParamsOp,
    incarnation: str,
    run: str,
    token: str,
    suffix: str,
    index: int = 0,
    body: str = "",
    call_id: str = "",
    rebuild: Sequence[Rebuild] = (),
) -> ParamsReply:
    """Run params.lua.

    Args:
        op: 'add' (one entry at ``index`` with the params ``body``, JSON, named
            ``call_id``), 'load' (the entries ``body``, a JSON array of ``index`` of
            them, for the run ``run``) or 'rebuild' (``rebuild``'s shards; ``index`` the
            frames dropped).
        token, suffix: the caller's claim token and its meta field suffix ('' or
            ':<rank>').
    """
    tail: list[Arg] = []
    for shard in rebuild:
        tail += [shard.field, shard.kept, shard.g]
    return build_call(
        "params",
        ParamsReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "params": keys.params,
         "work": keys.work, "ledger": keys.ledger, "stats": keys.stats},
        {"incarnation": incarnation, "run": run, "token": token, "sfx": suffix, "op": op,
         "index": index, "body": body, "call_id": call_id,
         "max_bytes": PARAMS_LOG_MAX_BYTES},
        more_args=tail,
    ).run(client)  # fmt: skip
