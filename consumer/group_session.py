"""A trainer's hold on a run read by several groups (:mod:`batchq.protocol.groups`).

:class:`GroupSession` is the :class:`consumer.session.Session` of every stream: a stream
with ``group=`` claims, refreshes, resumes and finishes its group's place through the
group scripts (gclaim.lua, gresume.lua) from the start; a stream without one is the
default group and uses the scripts of a single trainer until they answer that the run
is read by several groups (:class:`~batchq.errors.RunGrouped`, or a pop's reply says so:
:meth:`GroupSession.saw_groups`), and the group scripts from then on.

Once claimed, the session reads its group's *slot*: its keys (:attr:`Session.keys`, a
:meth:`batchq.protocol.keys.QueueKeys.slot_view`), its list (:attr:`Session.data_key`)
and the suffix of its meta fields (:attr:`Session.suffix`). Slot 0 keeps the plain
names, so the first group of a run reads it as a single trainer would.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any

import redis

from batchq.errors import (
    ConfigError,
    GroupWorldMismatch,
    ProtocolError,
    RunGrouped,
    StepMismatch,
    TooManyGroups,
    TrainerConflict,
)
from batchq.protocol import scripts
from batchq.protocol.fields import MetaField
from batchq.protocol.group_scripts import GClaimReply, GResumeReply, GroupClaimOp
from batchq.protocol.groups import check_group, reader_field
from batchq.protocol.layout import MAX_GROUPS
from batchq.protocol.replies import status_error
from batchq.protocol.words import Status, as_int
from consumer.checkpoint import GROUP_KEY
from consumer.plan import Restart
from consumer.session import Session, rank_hint

__all__ = [
    "GROUPS_TRIES",
    "GroupSession",
    "check_group_state",
    "group_resume_run_id",
    "refuse_params",
]

log = logging.getLogger(__name__)

# A group script answers GROUPS when the run's groups changed since the caller read them
# (another group registered meanwhile): read again, at most this many times in a row.
GROUPS_TRIES = 20


def check_group_state(state: dict[str, Any], group: str | None) -> dict[str, Any]:
    """A checkpoint's state for a stream of ``group``: refused when it names another
    group (each group's position is its own); a state without a group (the default
    group's, or saved before groups) is taken as it is.

    Raises:
        ConfigError: the state names another group.
    """
    saved = state.get(GROUP_KEY)
    if saved is not None and saved != (group or ""):
        raise ConfigError(
            f"state is of group {saved or '(default)'!r}, this stream reads group "
            f"{group or '(default)'!r}; expected a state_dict() of the same group"
        )
    return state


def refuse_params(session: Session | None) -> None:
    """``set_params`` is not for a run read by several groups: one build serves every
    group, so no group may steer the producers for itself.

    Raises:
        ConfigError: the session reads a group of such a run.
    """
    if isinstance(session, GroupSession) and session.grouped:
        raise ConfigError(
            f"{session.what}: set_params changes what the producers build for every group "
            "of the run (each batch is built once for all): not supported in a run read by "
            "several groups"
        )


def group_resume_run_id(state: dict[str, Any], world: int) -> str:
    """The run the groups (and ranks) resuming one checkpoint's run resume into: the same
    for all, so the first creates it and the others join it (as
    :func:`consumer.rank_state.resume_run_id`, for any world)."""
    text = f"resume:{state.get('run')}:{world}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class GroupSession(Session):
    """A trainer's claim on one queue, as one group of its run (see the module docstring).

    Args:
        *args: :class:`Session`'s positional arguments (client, keys, claim_ttl_ms,
            retry_s).
        group: the group's name; None: the default group (a single trainer's session
            until the run is read by several groups).
        max_lag_batches: how many batches this group may fall behind the leading group
            before the others stop waiting for it (None: they always wait).
        **options: the rest of :class:`Session`'s arguments.
    """

    def __init__(
        self,
        *args: Any,
        group: str | None = None,
        max_lag_batches: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(*args, **options)
        self.base_keys = self.keys  # the run's own; self.keys: the slot read
        self.group = check_group(group)
        self.grouped = group is not None  # through the group scripts
        self.groups = 0  # the run's group slots, as the last claim or pop said
        self.max_lag_batches = max_lag_batches
        self.checkpoint_run = ""  # the run a resume takes over (acquire's takeover)

    @property
    def what(self) -> str:
        """'queue Q[ group G][ rank r]', for messages."""
        group = f" group {self.group}" if self.group else ""
        rank = f" rank {self.rank}" if self.world > 1 else ""
        return f"queue {self.base_keys.queue}{group}{rank}"

    def saw_groups(self, groups: int) -> None:
        """A pop's reply says the run is read by ``groups`` group slots (the reader's
        thread): from now on this session claims, resumes and finishes through the
        group scripts."""
        if groups > 0 and not self.grouped:
            log.info("%s: the run is read by %d groups now", self.what, groups)
            with self._lock:
                self.grouped = True
                self.groups = groups

    # -- the claim -----------------------------------------------------------------------

    def acquire(
        self, takeover: str = "", client: redis.Redis | None = None, *, resuming: bool = False
    ) -> bool:
        """Claim the queue as this group (see :meth:`Session.acquire`).

        Raises:
            TrainerConflict: another trainer of this group (and rank) holds it.
            GroupWorldMismatch: the run's groups read with another world size.
            TooManyGroups: the run has MAX_GROUPS groups already.
        """
        self.checkpoint_run = takeover
        if not self.grouped:
            try:
                return super().acquire(takeover, client, resuming=resuming)
            except RunGrouped:
                self.grouped = True
        client = client or self.client
        run = uuid.uuid4().hex[:16]  # the same on a retry: gclaim.lua knows its own try
        reply: GClaimReply = self._retry(
            lambda: self._gclaim(client, "acquire", takeover, run), "claiming", client
        )
        self._check_acquired(reply)
        with self._lock:
            self.incarnation, self.run, self.held = reply.incarnation, reply.run, reply.held
            self._use_slot(reply.slot, reply.groups)
        self.claimed = True
        if not resuming:
            self._published(client)
        return reply.new_run

    def _check_acquired(self, reply: GClaimReply) -> None:
        """Raise what a refused acquire means."""
        if reply.status == Status.CONFLICT:
            raise TrainerConflict(
                f"{self.what} is held by another trainer (its claim lapses in "
                f"{reply.value / 1000:.1f} s unless it is alive); use another group, or "
                f"resume its run with load_state_dict{rank_hint(self.world)}"
            )
        if reply.status == Status.WORLD:
            raise GroupWorldMismatch(self.base_keys.queue, self.group, reply.value, self.world)
        if reply.status == Status.FULL:
            raise TooManyGroups(
                f"queue {self.base_keys.queue}: its run is read by {reply.value} groups, the "
                f"most a run has ({MAX_GROUPS}); group {self.group!r} cannot join it"
            )
        if reply.status != Status.OK:
            raise status_error(reply.status, self.what)

    def _use_slot(self, slot: int, groups: int) -> None:
        """Read group slot ``slot`` of a run of ``groups`` slots (0: not read by groups:
        the default group reads it as a single trainer); under the lock."""
        self.slot, self.groups = slot, groups
        self.grouped = groups > 0 or self.group != ""
        self.keys = self.base_keys.slot_view(slot)
        self.data_key = self.keys.data_of(self.rank, self.world)
        self.suffix = reader_field("", slot, self.rank, self.world)

    def refresh(self, client: redis.Redis) -> None:
        """Keep the claim alive (see :meth:`Session.refresh`)."""
        if not self.grouped:
            super().refresh(client)
            return
        status = self._gclaim(client, "refresh").status
        if status != Status.OK:
            raise status_error(status, self.what)

    def release(self, finished: bool) -> bool:
        """Give the claim up; with ``finished`` this rank of the group is done, and the
        run ends once every rank of every group is (see :meth:`Session.release`).

        Returns:
            True if the run ended.
        """
        if not self.claimed:
            return False
        if not self.grouped:
            try:
                return super().release(finished)
            except RunGrouped:
                self.grouped = True
        op: GroupClaimOp = "finish" if finished else "release"
        reply: GClaimReply = self._retry(
            lambda: self._gclaim(self.client, op), f"{op} of the claim"
        )
        self.claimed = False
        return finished and reply.run_done

    def reclaim(self, client: redis.Redis) -> None:
        """Claim the queue again after Redis lost its state (see
        :meth:`Session.reclaim`): every group recovers into the run named after the new
        incarnation."""
        super().reclaim(client)
        if self.grouped:
            self.resume_run = hashlib.sha1(f"lost:{self.incarnation}".encode()).hexdigest()[:16]

    def _gclaim(
        self, client: redis.Redis, op: GroupClaimOp, takeover: str = "", run: str = ""
    ) -> GClaimReply:
        """One gclaim.lua call, with the keys of every group slot the run has (read again
        while another group registers meanwhile)."""
        for _ in range(GROUPS_TRIES):
            groups, key_world = self._read_shape(client)
            with self._typed_errors(client):
                reply = scripts.gclaim(
                    client, self.base_keys, group=self.group, groups=groups,
                    key_world=key_world, max_lag=self.max_lag_batches, slot=self.slot,
                    **self._claim_args(op, takeover, run),
                )  # fmt: skip
            if reply.status != Status.GROUPS:
                return reply
        raise ProtocolError(f"{self.what}: the run's groups kept changing while claiming")

    def _read_shape(self, client: redis.Redis) -> tuple[int, int]:
        """(the run's group slots, the ranks to send each slot's keys for)."""
        groups, world = client.hmget(self.base_keys.meta, [MetaField.GROUPS, MetaField.WORLD])
        return as_int(groups), max(self.world, as_int(world) or 1)

    # -- a restart from a ledger --------------------------------------------------------

    def _restart(self, client: redis.Redis, asked: Restart) -> None:
        """Restart this group's plan (see :meth:`Session.resume`): in the checkpoint's
        run, if the queue still runs it, the other groups read on.

        Raises:
            StepMismatch: another rank of the group resumed from another step.
            ConfigError: a checkpoint of another number of ranks, in a run of groups.
        """
        if not self.grouped:
            try:
                self._resume_alone(client, asked)
                return
            except RunGrouped:
                self.grouped = True
        if asked.remap is not None:
            raise ConfigError(
                f"{self.what}: a checkpoint of another number of ranks cannot resume a "
                "group (its epoch's slots would be split unlike the other groups'); resume "
                "it with the world_size it was saved with"
            )
        new_run = self.resume_run or uuid.uuid4().hex[:16]

        def call() -> GResumeReply:
            for _ in range(GROUPS_TRIES):
                groups, key_world = self._read_shape(client)
                reply = scripts.gresume(
                    client, self.base_keys, takeover_run=self.checkpoint_run,
                    group=self.group, groups=groups, key_world=key_world, slot=self.slot,
                    acquired=self.run, claim_ttl_ms=self.claim_ttl_ms, ledger=asked.ledger,
                    **self._resume_args(asked, new_run),
                )  # fmt: skip
                if reply.status != Status.GROUPS:
                    return reply
            raise ProtocolError(f"{self.what}: the run's groups kept changing while resuming")

        reply: GResumeReply = self._retry(call, "resuming", client)
        if reply.status == Status.STEP:
            raise StepMismatch(
                f"{self.what}: resumed from a state at step {asked.step}, but the group's "
                f"other ranks resumed from step {reply.text}; expected the states of one "
                "checkpoint"
            )
        if reply.status != Status.OK:
            raise TrainerConflict(f"{self.what}: the claim was lost while resuming")
        with self._lock:
            self.run = reply.run
            self._use_slot(reply.slot, reply.groups)
