"""The scripts of a run read by several groups (:mod:`batchq.protocol.groups`), one typed
function each, with their replies: the producer's lease (glease.lua) and capped push into
every target group's list (gpush.lua), both built as a :class:`Call` (they travel in
pipelines), the trainer's claim (gclaim.lua) and resume (gresume.lua) of its group, and
the release of frames stored once for several groups (release.lua, a :class:`Call` that
rides behind the reader's GETs).

The group scripts need the keys of every group slot of the run (``QueueKeys.slot_tails``,
``glease_tails``, ``gpush_tails``): the caller reads how many slots the run has (meta
``groups``) and the scripts answer ``{'GROUPS', n}`` when that changed meanwhile, so the
caller reads again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Unpack, cast

import redis

from batchq.protocol.calls import Arg, Call, build_call, decode_reply, reply_int
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import FLAGS, MAX_GROUPS, WAKE_CAP
from batchq.protocol.script_args import Argv, ClaimArgs, ClaimOp, LeaseArgs, PushArgs, ResumeArgs
from batchq.protocol.trainer_scripts import ClaimReply
from batchq.protocol.words import Status

__all__ = [
    "GClaimReply",
    "GLeaseReply",
    "GPushReply",
    "GResumeReply",
    "GroupClaimOp",
    "ReleaseReply",
    "gclaim",
    "glease_call",
    "gpush_call",
    "gresume",
    "release_call",
]

GroupClaimOp = ClaimOp  # the same ops as a single trainer's claim


class GLeaseReply(NamedTuple):
    """glease.lua: ``{'OK', g, skip, slots, world, mask, params stamp}``, ``{'WAIT',
    slot}``, ``{'GROUPS', n}`` or a status (``mask``: the group slots the shard is built
    for; ``params``: meta's params stamp, as lease.lua's; with GROUPS, ``groups`` is n;
    with WAIT, ``slot`` is the group whose floor holds the shared stream, -1 for none)."""

    status: str
    g: int = 0
    skip: int = 0
    slots: int = 0
    world: int = 1
    mask: int = 1
    groups: int = 0
    slot: int = -1
    params: str = ""

    @property
    def shard(self) -> None:
        """A remapped slot's shard: never in a run of several groups."""
        return None

    @classmethod
    def parse(cls, raw: Any) -> GLeaseReply:
        """From glease.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.GROUPS:
            return cls(r[0], groups=reply_int(r, 1))
        if r[0] == Status.WAIT:
            return cls(r[0], slot=reply_int(r, 1, -1))
        if r[0] != Status.OK:
            return cls(r[0])
        stamp = str(r[6]) if len(r) > 6 else ""
        return cls(r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), params=stamp)


class GPushReply(NamedTuple):
    """gpush.lua: ``{'OK', depth, dropped}``, ``{'FULL', depth, slot}``, ``{'DROPPED',
    mask}``, ``{'WRONG_TYPE', key, type}`` or a status (``dropped``: the group slots whose
    full lists the frame left out, their shard gone back for them; ``slot``: FULL's, the
    group whose list is full)."""

    status: str
    depth: int = 0
    dropped: int = 0
    key: str = ""
    found: str = ""
    slot: int = -1

    @classmethod
    def parse(cls, raw: Any) -> GPushReply:
        """From gpush.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.WRONG_TYPE:
            return cls(r[0], key=str(r[1]), found=str(r[2]))
        if r[0] == Status.DROPPED:
            return cls(r[0], dropped=reply_int(r, 1))
        if r[0] == Status.FULL:
            return cls(r[0], reply_int(r, 1), slot=reply_int(r, 2, -1))
        return cls(r[0], reply_int(r, 1), reply_int(r, 2))


class GClaimReply(ClaimReply):
    """gclaim.lua. acquire: ``{'OK', incarnation, run, new_run, fence, held, slot,
    groups}``, ``{'CONFLICT', ms}``, ``{'WORLD', world}``, ``{'FULL', groups}``,
    ``{'GROUPS', groups}``; refresh, release: ``{'OK'}`` or a status; finish: ``{'OK',
    group done, run ended}`` (the fields: :class:`~batchq.protocol.replies.ClaimReply`).
    """

    @classmethod
    def parse(cls, raw: Any) -> GClaimReply:
        """From gclaim.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] != Status.OK:
            return cls(r[0], value=reply_int(r, 1, -1))
        if len(r) == 3:  # finish
            return cls(r[0], group_done=bool(int(r[1])), run_done=bool(int(r[2])))
        if len(r) == 1:
            return cls(r[0])
        return cls(r[0], r[1], r[2], bool(int(r[3])), int(r[4]), bool(int(r[5])), int(r[6]),
                   int(r[7]))  # fmt: skip


class GResumeReply(NamedTuple):
    """gresume.lua: ``{'OK', run, slot, groups}``, ``{'STEP', step}``, ``{'GROUPS', n}``
    or a status (``text``: STEP's step)."""

    status: str
    run: str = ""
    slot: int = 0
    groups: int = 0
    text: str = ""

    @classmethod
    def parse(cls, raw: Any) -> GResumeReply:
        """From gresume.lua's raw reply."""
        r = decode_reply(raw)
        if r[0] == Status.OK:
            return cls(r[0], str(r[1]), int(r[2]), int(r[3]))
        if r[0] == Status.GROUPS:
            return cls(r[0], groups=reply_int(r, 1))
        return cls(r[0], text=str(r[1]) if len(r) > 1 else "")


def glease_call(
    keys: QueueKeys, *, groups: int, world: int, **shared: Unpack[LeaseArgs]
) -> Call[GLeaseReply]:
    """A producer's next lease in a run of ``groups`` group slots and ``world`` ranks
    (glease.lua; ``shared``, ``prefetch`` and ``after`` as
    :func:`batchq.protocol.scripts.lease_call`'s)."""
    return build_call(
        "glease",
        GLeaseReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "work": keys.work,
         "lease": keys.leases[shared["producer"]], "producers": keys.producers},
        {"after": "", **cast(Argv, shared), "prefetch": int(shared["prefetch"]),
         "groups": groups},
        more_keys=keys.glease_tails[groups, world],
    )  # fmt: skip


def gpush_call(
    keys: QueueKeys,
    *,
    targets: int,
    rank: int,
    world: int,
    frame_key: str | None,
    **shared: Unpack[PushArgs],
) -> Call[GPushReply]:
    """The capped push of one frame into rank ``rank``'s list of every group slot of
    ``targets`` (a mask; gpush.lua; ``shared``: see
    :class:`~batchq.protocol.script_args.PushArgs`); ``frame_key`` names a frame stored
    by reference (None: inline); ``shm_host``: the element is a shared-memory descriptor
    of that host, pushed only into lists whose trainers published it."""
    tail = keys.gpush_tails[targets, rank, world]
    if frame_key is not None:
        tail = [*tail, frame_key]
    return build_call(
        "gpush",
        GPushReply.parse,
        {"meta": keys.meta, "incarnation": keys.incarnation, "stats": keys.stats,
         "producers": keys.producers, "lease": keys.leases[shared["producer"]],
         "pstats": keys.pstats, "refs": keys.refs, "work": keys.work},
        {"shm_host": "", **cast(Argv, shared), "last": FLAGS[shared["last"]], "rank": rank,
         "targets": targets, "by_ref": FLAGS[frame_key is not None]},
        more_keys=tail,
    )  # fmt: skip


def gclaim(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    group: str,
    groups: int,
    key_world: int,
    max_lag: int | None,
    slot: int,
    **shared: Unpack[ClaimArgs],
) -> GClaimReply:
    """Acquire, refresh, release or finish a group's claim (gclaim.lua; ``shared``: see
    :class:`~batchq.protocol.script_args.ClaimArgs`).

    Args:
        groups: the run's group slots as the caller read them (meta ``groups``).
        key_world: the ranks to send each slot's keys for (at least the run's world and
            the caller's).
        max_lag: acquire: the group's max_lag_batches (None: the others wait for it).
        slot: refresh, release, finish: the caller's slot.
    """
    return build_call(
        "gclaim",
        GClaimReply.parse,
        _slot_keys(keys),
        {"incarnation": "", **cast(Argv, shared), "group": group, "groups": groups,
         "key_world": key_world, "max_lag": "" if max_lag is None else max_lag,
         "slot_arg": slot, "max_groups": MAX_GROUPS},
        more_keys=keys.slot_tails[groups, key_world],
    ).run(client)  # fmt: skip


def gresume(
    client: redis.Redis,
    keys: QueueKeys,
    *,
    takeover_run: str,
    group: str,
    groups: int,
    key_world: int,
    slot: int,
    acquired: str,
    claim_ttl_ms: int,
    ledger: Sequence[tuple[str, str]],
    **shared: Unpack[ResumeArgs],
) -> GResumeReply:
    """Restart a group's plan from a ledger (gresume.lua; ``shared``: see
    :class:`~batchq.protocol.script_args.ResumeArgs`).

    Args:
        takeover_run: the checkpoint's run (it lives on if the queue still runs it).
        slot, acquired: the slot and run the caller's claim was made for.
        ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
    """
    pairs: list[Arg] = []
    for field, value in ledger:
        pairs += [field, value]
    return build_call(
        "gresume",
        GResumeReply.parse,
        _slot_keys(keys),
        {**cast(Argv, shared), "held": FLAGS[shared["held"]], "wake_cap": WAKE_CAP,
         "takeover_run": takeover_run, "group": group, "groups": groups,
         "key_world": key_world, "slot_arg": slot, "acquired": acquired,
         "claim_ttl_ms": claim_ttl_ms},
        more_keys=keys.slot_tails[groups, key_world],
        more_args=pairs,
    ).run(client)  # fmt: skip


def _slot_keys(keys: QueueKeys) -> dict[str, str | None]:
    """The KEYS gclaim.lua and gresume.lua name before their tail."""
    return {"meta": keys.meta, "incarnation": keys.incarnation, "groups": keys.groups,
            "work": keys.work, "wake": keys.wake, "failures": keys.failures,
            "refs": keys.refs, "remap": keys.remap}  # fmt: skip


class ReleaseReply(NamedTuple):
    """release.lua: ``{'OK', frames deleted}``."""

    status: str
    deleted: int = 0

    @classmethod
    def parse(cls, raw: Any) -> ReleaseReply:
        """From release.lua's raw reply."""
        r = decode_reply(raw)
        return cls(r[0], reply_int(r, 1))


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
