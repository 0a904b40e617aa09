"""The trainer's scripts, one typed function each (see :mod:`batchq.protocol.scripts`):
its claim (claim.lua), the pop and its accounting (pop.lua), and a restart from a
checkpoint's ledger (resume.lua).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Unpack, cast

import redis

from batchq.protocol.calls import Arg, CountReply, build_call, decode_reply, reply_int
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import FLAGS, HISTORY_CAP, WAKE_CAP
from batchq.protocol.script_args import Argv, ClaimArgs, ClaimOp, ResumeArgs
from batchq.protocol.words import Status

__all__ = ["ClaimOp", "ClaimReply", "PopReply", "claim", "pop", "resume"]


class ClaimReply(NamedTuple):
    """claim.lua. acquire: ``{'OK', incarnation, run, new_run, fence[, held]}``,
    ``{'CONFLICT', ms}``, ``{'WORLD', world}``; the other ops ``{'OK'[, last]}`` or
    ``{'CLAIM_LOST'}``. gclaim.lua's reply is one too, with what only a group's claim
    says (:class:`batchq.protocol.group_scripts.GClaimReply`).

    Attributes:
        slot, groups: a group's acquire: the group slot it reads and the run's group
            slots (0 and 0 from claim.lua).
        value: CONFLICT's ms until the other claim lapses, WORLD's world size, or a
            rank's finish: 1 if it was the last rank (else 0; -1 when not said);
            gclaim.lua's FULL and GROUPS: the run's group slots.
        group_done, run_done: a group's finish: every rank of the group finished; the
            run ended (every group finished).
    """

    status: str
    incarnation: str = ""
    run: str = ""
    new_run: bool = False
    fence: int = 0
    held: bool = False
    slot: int = 0
    groups: int = 0
    value: int = -1
    group_done: bool = False
    run_done: bool = False

    @classmethod
    def parse(cls, raw: Any) -> ClaimReply:
        """From claim.lua's raw reply."""
        r = decode_reply(raw)
        if len(r) == 2:  # CONFLICT, WORLD, or finish's {'OK', last}
            return cls(r[0], value=int(r[1]))
        if r[0] != Status.OK or len(r) == 1:
            return cls(r[0])
        return cls(r[0], r[1], r[2], bool(int(r[3])), int(r[4]), bool(reply_int(r, 5)))


class PopReply(NamedTuple):
    """pop.lua: ``{'OK', producers alive, depth before the pop, {elements}, group
    slots}``, ``{'WRONG_TYPE', key, type}`` or a status. Elements stay bytes: they are
    data. ``groups``: the run's group slots (0: read by one group)."""

    status: str
    alive: int = 0
    depth: int = 0
    elements: list[bytes] = []  # a NamedTuple default, never mutated
    key: str = ""
    found: str = ""
    groups: int = 0

    @classmethod
    def parse(cls, raw: Any) -> PopReply:
        """From pop.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.WRONG_TYPE:
            return cls(r[0], key=str(r[1]), found=str(r[2]))
        if r[0] != Status.OK:
            return cls(r[0])
        return cls(r[0], int(r[1]), int(r[2]), list(r[3]), groups=reply_int(r, 4))


def _trainer_keys(keys: QueueKeys) -> dict[str, str | None]:
    return {"meta": keys.meta, "incarnation": keys.incarnation, "data": keys.data,
            "work": keys.work}  # fmt: skip


def claim(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    rank_lists: Sequence[str] = (),
    **shared: Unpack[ClaimArgs],
) -> ClaimReply:
    """Acquire, refresh, release or finish a trainer's claim (claim.lua; ``shared``: see
    :class:`~batchq.protocol.script_args.ClaimArgs`).

    Args:
        rank_lists: what a new or finished run drops besides the queue's own lists
            (data-parallel: every rank's data list, the counts and remap hashes).
    """
    return build_call(
        "claim",
        ClaimReply.parse,
        {**_trainer_keys(keys), "wake": keys.wake, "failures": keys.failures,
         "ledger": keys.ledger},
        {"incarnation": "", **cast(Argv, shared)},
        more_keys=rank_lists,
    ).run(client)  # fmt: skip


def pop(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    data: str,
    trainer: str,
    history: str,
    incarnation: str,
    run: str,
    token: str,
    room: int,
    floor: int,
    claim_ttl_ms: int,
    extra_popped: int,
    nbytes: int,
    figures: Sequence[Arg],
    suffix: str,
) -> PopReply:
    """The trainer's pop and accounting (pop.lua).

    Args:
        data, trainer, history: this rank's data list, figures hash and history list.
        figures: what :meth:`consumer.stats.TrainerStats.drain` returns (6 values):
            waited ms, busy ms, epochs, histogram increments, figures JSON, history
            sample JSON.
    """
    waited_ms, busy_ms, epochs, buckets, figures_json, sample = figures
    return build_call(
        "pop",
        PopReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "data": data,
         "wake": keys.wake, "stats": keys.stats, "producers": keys.producers,
         "trainer": trainer, "history": history, "pstats": keys.pstats},
        {"incarnation": incarnation, "run": run, "token": token, "room": room,
         "floor": floor, "claim_ttl_ms": claim_ttl_ms, "extra_popped": extra_popped,
         "nbytes": nbytes, "waited_ms": waited_ms, "busy_ms": busy_ms, "epochs": epochs,
         "buckets": buckets, "figures": figures_json, "sample": sample, "sfx": suffix,
         "wake_cap": WAKE_CAP, "history_cap": HISTORY_CAP},
    ).run(client)  # fmt: skip


def resume(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    rank_lists: Sequence[str],
    remap: tuple[int, Mapping[int, int]] | None,
    ledger: Sequence[tuple[str, str]],
    **shared: Unpack[ResumeArgs],
) -> CountReply:
    """Restart the plan from a ledger (resume.lua; ``shared``: see
    :class:`~batchq.protocol.script_args.ResumeArgs`): ``text`` is the run on OK, the
    run's step on STEP.

    Args:
        rank_lists: data-parallel: this rank's data list first, the others', the counts
            and remap hashes (remap last).
        remap: (epoch, slot -> shard) of a job resumed with another number of ranks.
        ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
    """
    tail: list[Arg] = []
    for slot, shard in (remap[1] if remap else {}).items():
        tail += [slot, shard]
    for field, value in ledger:
        tail += [field, value]
    return build_call(
        "resume",
        CountReply.parse,
        {**_trainer_keys(keys), "failures": keys.failures, "ledger": keys.ledger,
         "wake": keys.wake},
        {**cast(Argv, shared), "held": FLAGS[shared["held"]], "wake_cap": WAKE_CAP,
         "remap_epoch": "" if remap is None else remap[0],
         "remapped": 0 if remap is None else len(remap[1])},
        more_keys=rank_lists,
        more_args=tail,
    ).run(client)  # fmt: skip
