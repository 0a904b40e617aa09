"""The trainer's scripts, one typed function each (see :mod:`batchq.protocol.calls`):
its claim (claim.lua) and a restart from a checkpoint's ledger (resume.lua), as one group
of a run read by one group or several (:mod:`batchq.protocol.groups`), the pop and its
accounting (pop.lua), the release of frames stored once for several groups
(release.lua, a :class:`~batchq.protocol.calls.Call` that rides behind the reader's
GETs), and a single trainer's detach (detach.lua).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import redis

from batchq.protocol.calls import Arg, Call, CountReply, build_call, decode_reply, reply_int
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import FLAGS, HISTORY_CAP, MAX_GROUPS, WAKE_CAP
from batchq.protocol.words import Status

__all__ = [
    "ClaimOp",
    "ClaimReply",
    "PopReply",
    "ReleaseReply",
    "ResumeArgs",
    "ResumeReply",
    "claim",
    "detach",
    "pop",
    "release_call",
    "resume",
]

ClaimOp = Literal["acquire", "refresh", "release", "finish"]


class ClaimReply(NamedTuple):
    """claim.lua. acquire: ``{'OK', incarnation, run, new_run, fence, held, slot,
    groups, retired}``, ``{'CONFLICT', ms}``, ``{'WORLD', world}``, ``{'FULL', groups}``,
    ``{'GROUPS', groups}``; refresh, release: ``{'OK'}`` or a status; finish: ``{'OK',
    group done, run ended}`` or a status.

    Attributes:
        new_run: acquire: the claim started a new run.
        fence: acquire: meta's fence (one more per acquire; a retried one's as it is).
        held: acquire: this rank had claimed the resumed run before.
        slot, groups: acquire: the group slot the trainer reads and the run's group
            slots (0: the run is not read by several groups).
        retired: acquire: the group's slot of another world that it left for ``slot``
            (it came back with another number of ranks), whose lists the trainer
            drains; -1 for none.
        value: CONFLICT's ms until the other claim lapses, WORLD's world size, FULL's
            and GROUPS' group slots.
        holder: CONFLICT's holder: the name its connections carry ('' for none).
        group_done, run_done: finish: every rank of the trainer's group finished; the
            run ended (every rank of every group finished).
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
    retired: int = -1
    holder: str = ""

    @classmethod
    def parse(cls, raw: Any) -> ClaimReply:
        """From claim.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] != Status.OK:
            holder = str(r[2]) if r[0] == Status.CONFLICT and len(r) > 2 else ""
            return cls(r[0], value=reply_int(r, 1, -1), holder=holder)
        if len(r) == 3:  # finish
            return cls(r[0], group_done=bool(int(r[1])), run_done=bool(int(r[2])))
        if len(r) == 1:
            return cls(r[0])
        return cls(r[0], r[1], r[2], bool(int(r[3])), int(r[4]), bool(int(r[5])), int(r[6]),
                   int(r[7]), retired=reply_int(r, 8, -1))  # fmt: skip


class ResumeReply(NamedTuple):
    """resume.lua: ``{'OK', run, slot, groups}``, ``{'STEP', step}``, ``{'GROUPS', n}``
    or a status (``text``: STEP's step)."""

    status: str
    run: str = ""
    slot: int = 0
    groups: int = 0
    text: str = ""

    @classmethod
    def parse(cls, raw: Any) -> ResumeReply:
        """From resume.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.OK:
            return cls(r[0], str(r[1]), int(r[2]), int(r[3]))
        if r[0] == Status.GROUPS:
            return cls(r[0], groups=reply_int(r, 1))
        return cls(r[0], text=str(r[1]) if len(r) > 1 else "")


class ReleaseReply(NamedTuple):
    """release.lua: ``{'OK', frames deleted}``."""

    status: str
    deleted: int = 0

    @classmethod
    def parse(cls, raw: Any) -> ReleaseReply:
        """From release.lua's raw reply."""
        r = decode_reply(raw)
        return cls(r[0], reply_int(r, 1))


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


def _run_keys(keys: QueueKeys) -> dict[str, str | None]:
    """The KEYS claim.lua and resume.lua name before their tail."""
    return {"meta": keys.meta, "incarnation": keys.incarnation, "data": keys.data,
            "groups": keys.groups, "work": keys.work, "wake": keys.wake,
            "failures": keys.failures, "refs": keys.refs, "remap": keys.remap}  # fmt: skip


def claim(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    op: ClaimOp,
    token: str,
    claim_ttl_ms: int,
    run_id: str,
    new_incarnation: str,
    takeover_run: str,
    version: str,
    rank: int,
    world: int,
    even: str,
    resumed: str,
    group: str = "",
    incarnation: str = "",
    groups: int = 0,
    key_world: int | None = None,
    max_lag: int | None = None,
    slot: int = 0,
    name: str = "",
    dead: str = "",
) -> ClaimReply:
    """Acquire, refresh, release or finish a trainer's claim as one rank of ``group``
    ('' the default group) (claim.lua).

    Args:
        token: the trainer's claim token.
        run_id, new_incarnation: the run id a new run gets, the incarnation a queue
            created now gets.
        takeover_run, resumed: run ids to take over ('' for none): a checkpoint's, and
            the run the job's ranks resume into.
        incarnation: the queue's incarnation the claim was made in ('' for an acquire;
            another answers STATE_LOST).
        groups: the run's group slots as the caller read them (meta ``groups``).
        key_world: the ranks to send each slot's keys for (at least the run's world and
            the caller's; None: the caller's).
        max_lag: acquire: the group's max_lag_batches (None: the others wait for it).
        slot: refresh, release, finish: the caller's slot.
        name: acquire: the name the caller's connections carry (CLIENT SETNAME; ''
            for none), recorded with the claim.
        dead: acquire: a holder's name none of whose connections is open (its process
            died): its claim is taken even before it lapses.
    """
    key_world = key_world or world
    return build_call(
        "claim",
        ClaimReply.parse,
        _run_keys(keys),
        {"token": token, "claim_ttl_ms": claim_ttl_ms, "op": op, "run_id": run_id,
         "new_incarnation": new_incarnation, "takeover_run": takeover_run,
         "version": version, "group": group, "rank": rank, "world": world, "even": even,
         "resumed": resumed, "incarnation": incarnation, "groups": groups,
         "key_world": key_world, "max_lag": "" if max_lag is None else max_lag,
         "slot_arg": slot, "max_groups": MAX_GROUPS, "name": name, "dead": dead},
        more_keys=keys.slot_tails[groups, key_world],
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


class ResumeArgs(NamedTuple):
    """What a restart from a ledger takes besides the keys: the new run, the
    checkpoint's run (``takeover_run``: it lives on in a run read by several groups, if
    the queue still runs it), the first shard, the plan's figures, the trainer's group
    and place, the checkpoint's step, whether the rank held the run before, the slot and
    run its claim was made for; ``keep``: a single trainer of the default group takes the
    checkpoint's run over as it is where it detached at this position (the state's
    digest, :func:`consumer.checkpoint.position_digest`; '' for never)."""

    token: str
    new_run: str
    takeover_run: str
    first: int
    fingerprint: str
    hwm: int | str
    shards: int
    window: int
    epoch_batches: int
    group: str
    rank: int
    world: int
    even: str
    step: int
    held: bool
    slot: int
    acquired: str
    claim_ttl_ms: int
    keep: str = ""


def resume(
    client: redis.Redis,
    keys: QueueKeys,
    asked: ResumeArgs,
    *,
    groups: int,
    key_world: int,
    remap: tuple[int, Mapping[int, int]] | None,
    ledger: Sequence[tuple[str, str]],
) -> ResumeReply:
    """Restart a group's plan from a ledger (resume.lua).

    Args:
        asked: what the restart is.
        groups, key_world: as :func:`claim`'s.
        remap: (epoch, slot -> shard) of a job resumed with another number of ranks.
        ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
    """
    tail: list[Arg] = []
    for slot, shard in (remap[1] if remap else {}).items():
        tail += [slot, shard]
    for field, value in ledger:
        tail += [field, value]
    args: dict[str, Arg] = {**asked._asdict(), "held": FLAGS[asked.held]}
    args["slot_arg"] = args.pop("slot")
    return build_call(
        "resume",
        ResumeReply.parse,
        _run_keys(keys),
        {**args, "groups": groups, "key_world": key_world, "wake_cap": WAKE_CAP,
         "remap_epoch": "" if remap is None else remap[0],
         "remapped": 0 if remap is None else len(remap[1])},
        more_keys=keys.slot_tails[groups, key_world],
        more_args=tail,
    ).run(client)  # fmt: skip


def release_call(keys: QueueKeys, frames: Sequence[str]) -> Call[ReleaseReply]:
    """The release of frames stored by reference that a reader has read (release.lua);
    sent behind their GETs in one round trip."""
    return build_call(
        "release",
        ReleaseReply.parse,
        {"refs": keys.refs},
        {"frames": len(frames)},
        more_keys=list(frames),
    )


def detach(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    incarnation: str,
    run: str,
    token: str,
    position: str,
    frames: Sequence[Arg],
    final: bool = True,
) -> CountReply:
    """A single trainer stops without finishing (detach.lua): ``frames`` (encoded, the
    last to hand out first) go back to the data list's popping end and, with ``final``
    (the call that gives back the next frame to hand out), meta says the run was
    detached at ``position`` (its state's digest). ``first``: the frames given back."""
    return build_call(
        "detach",
        CountReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "data": keys.data,
         "stats": keys.stats},
        {"incarnation": incarnation, "run": run, "token": token, "position": position,
         "final": FLAGS[final]},
        more_args=list(frames),
    ).run(client)  # fmt: skip
