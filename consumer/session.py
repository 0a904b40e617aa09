"""The trainer's hold on a queue: its claim, the run it reads, and restarting the plan.

One object per ServerDataStream, shared by the stream (start, close) and its reader
thread (refresh, recovery after Redis lost the queue's state). Every call is one script
(claim.lua, resume.lua), as one group of the run (:mod:`batchq.protocol.groups`): a
stream with ``group=`` names its group, one without it is the default group, which a run
of one group reads through the scripts' fast path.

Once claimed, the session reads its group's *slot*: its keys (:attr:`Session.keys`, a
:meth:`batchq.protocol.keys.QueueKeys.slot_view`), its list (:attr:`Session.data_key`)
and the suffix of its meta fields (:attr:`Session.suffix`). Slot 0 keeps the plain
names, so the first group of a run reads it as a single trainer would.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from batchq.client.connection import client_name, is_wrong_type, retrying, wrong_type_error
from batchq.errors import (
    GroupWorldMismatch,
    ProtocolError,
    RunChanged,
    StateLost,
    StepMismatch,
    TooManyGroups,
    TrainerConflict,
    WorldSizeMismatch,
)
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import check_group, reader_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import MAX_GROUPS, lost_run_id, new_run_id
from batchq.protocol.ranks import RankLayout
from batchq.protocol.reaper import connected_names
from batchq.protocol.trainer_scripts import (
    ClaimOp,
    ClaimReply,
    ResumeArgs,
    ResumeReply,
    claim,
    resume,
)
from batchq.protocol.words import PROTOCOL_VERSION, Status, as_int, status_error
from consumer.plan import Plan, Restart, past_remap, resumed_shape, wait_for_plan

__all__ = ["Session", "rank_hint"]

# The scripts answer GROUPS when the run's groups changed since the caller read them
# (another group registered meanwhile): read again, at most this many times in a row.
_GROUPS_TRIES = 20


def rank_hint(world: int) -> str:
    """What a TrainerConflict of a single trainer adds: in a data-parallel job whose
    ranks were not found, every rank is a "single trainer" and all but one conflict."""
    if world > 1:
        return ""
    return (
        "; if this is one rank of a data-parallel job, pass rank= and world_size= (or make "
        "the stream after torch.distributed.init_process_group, or set RANK and WORLD_SIZE: "
        "they are found then)"
    )


log = logging.getLogger(__name__)


class Session:
    """A trainer's claim on one queue.

    Args:
        client: the client to use (each thread passes its own to the methods that take
            one).
        keys: the queue's keys.
        claim_ttl_ms: the claim lapses this long after its last refresh.
        retry_s: how long the stream's calls (acquire, release, plan wait, resume) keep
            retrying while the connection is lost (the reader has its own reconnect).
        rank: this trainer's rank in a data-parallel job (0 for a single trainer).
        world: the job's number of ranks (1: a single trainer).
        even: how ranks get equal counts, 'pad' or 'drop' (see :mod:`batchq.protocol.ranks`).
        resume_run: the run id the job's ranks resume a checkpoint into (see
            :meth:`resume`; '' for a single trainer, or when not resuming).
        publish: called with the acting client and the group slot read after every
            acquire not followed by a resume, and after every resume: claim.lua and
            resume.lua drop the rank's published shared-memory host, which the trainer
            publishes again there (:meth:`consumer.reader.shm_frames.TrainerShm.publish`).
        before_resume: called as ``(client, session, new run id)`` right before every
            resume.lua of a run of one group: the trainer's params log is written for
            the run first (:meth:`consumer.params.StreamParams.load`), so no producer
            serves the resumed run without it.
        group: the group's name; None: the default group.
        max_lag_batches: how many batches this group may fall behind the leading group
            before the others stop waiting for it (None: they always wait).
        drain: empties a data list of a group slot this group left (its keys, the
            list; consumer.reader.fetch.drain_group).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        claim_ttl_ms: int,
        retry_s: float = 60.0,
        *,
        rank: int = 0,
        world: int = 1,
        even: str = "pad",
        resume_run: str = "",
        publish: Callable[[redis.Redis, int], None] | None = None,
        before_resume: Callable[[redis.Redis, Session, str], None] | None = None,
        group: str | None = None,
        max_lag_batches: int | None = None,
        drain: Callable[[QueueKeys, str], object] | None = None,
    ) -> None:
        self.client = client
        self.retry_s = retry_s
        self.base_keys = keys  # the run's own; self.keys: the group slot's (slot_view)
        self.keys = keys
        self.claim_ttl_ms = claim_ttl_ms
        self.token = uuid.uuid4().hex
        self.incarnation = ""
        self.run = ""
        self.plan: Plan | None = None
        self.claimed = False
        self.rank, self.world, self.even = rank, world, even
        # A rank's meta fields end in ':<rank>' (world 1: nothing), see batchq/protocol/ranks.py.
        self.suffix = "" if world == 1 else f":{rank}"
        self.data_key = keys.data_of(rank, world)
        # The group slot read (batchq.protocol.groups): 0, the run's first group, whose
        # keys and fields keep the plain names.
        self.slot = 0
        self.group = check_group(group)
        self.grouped = group is not None  # a named group, or a run of several groups
        self.groups = 0  # the run's group slots, as the last claim or pop said
        self._key_world = world  # the ranks the scripts' KEYS name per slot
        self.max_lag_batches = max_lag_batches
        self.checkpoint_run = ""  # the run a resume takes over (acquire's takeover)
        self.held = False  # this rank had claimed the run before (a second resume)
        # A single trainer resuming a checkpoint (consumer.start's claim): a resume may
        # take the checkpoint's run over as it is where a trainer detached at that state
        # from this host (shm_identity: its shared-memory host, None without; resume.lua).
        self.can_keep = False
        self.shm_identity: str | None = None
        # The remap the run was resumed with (an elastic resume's epoch) and the done
        # slots past it: sent again when Redis loses the queue (the reader's recovery).
        self.remap: tuple[int, dict[int, int]] | None = None
        self.remap_done: list[tuple[str, str]] = []
        self.resume_run = resume_run  # the run id the job's ranks resume into (see resume)
        self._publish = publish
        self._before_resume = before_resume
        self._drain = drain
        # run, incarnation, held and plan change on the reader's thread too (recovery
        # after Redis lost the queue's state): written under this lock, read by position.
        self._lock = threading.Lock()

    @property
    def what(self) -> str:
        """'queue Q[ group G][ rank r]', for messages."""
        group = f" group {self.group}" if self.group else ""
        rank = f" rank {self.rank}" if self.world > 1 else ""
        return f"queue {self.base_keys.queue}{group}{rank}"

    def saw_groups(self, groups: int) -> None:
        """A pop's reply says the run is read by ``groups`` group slots (the reader's
        thread)."""
        if groups > 0 and not self.grouped:
            log.info("%s: the run is read by %d groups now", self.what, groups)
            with self._lock:
                self.grouped = True
                self.groups = groups

    def layout(self, shards: int) -> RankLayout:
        """This job's split of a plan of ``shards`` shards among its ranks."""
        return RankLayout(shards, self.world, self.even)

    def _retry(self, fn: Any, what: str, client: redis.Redis | None = None) -> Any:
        return retrying(
            fn, f"{what} (queue {self.keys.queue})", self.retry_s, client=client or self.client
        )

    def position(self) -> tuple[str, Plan | None]:
        """(run, plan), read together: the reader's recovery may change both."""
        with self._lock:
            return self.run, self.plan

    def _claim(
        self, client: redis.Redis, op: ClaimOp, takeover: str = "", run: str = "", dead: str = ""
    ) -> ClaimReply:
        """One claim.lua call, with the keys of every group slot the run has: read again
        for an acquire or a finish (while another group registers meanwhile), as last
        read for a refresh or a release."""
        for _ in range(_GROUPS_TRIES):
            with self._typed_errors(client):
                if op in ("acquire", "finish"):
                    self._read_shape(client)
                reply = claim(
                    client, self.base_keys, op=op, token=self.token,
                    claim_ttl_ms=self.claim_ttl_ms, run_id=run or new_run_id(),
                    new_incarnation=uuid.uuid4().hex, takeover_run=takeover,
                    version=PROTOCOL_VERSION, group=self.group, rank=self.rank,
                    world=self.world, even=self.even, resumed=self.resume_run,
                    incarnation="" if op == "acquire" else self.incarnation,
                    groups=self.groups, key_world=self._key_world,
                    max_lag=self.max_lag_batches, slot=self.slot,
                    name=client_name(client), dead=dead,
                )  # fmt: skip
            if reply.status != Status.GROUPS:
                return reply
        raise ProtocolError(f"{self.what}: the run's groups kept changing while claiming")

    def _read_shape(self, client: redis.Redis) -> None:
        """Read the run's group slots and the ranks to send each slot's keys for (this
        world's, and the largest of the run's group slots' if larger: each group reads
        with its own, and a new run drops every rank's lists)."""
        fields = [reader_field(MetaField.WORLD, i) for i in range(MAX_GROUPS)]
        groups, *worlds = client.hmget(self.base_keys.meta, [MetaField.GROUPS, *fields])
        with self._lock:
            self.groups = as_int(groups)
            self._key_world = max(self.world, *(as_int(w) or 1 for w in worlds))
            self.grouped = self.grouped or self.groups > 0

    @contextlib.contextmanager
    def _typed_errors(self, client: redis.Redis) -> Iterator[None]:
        """A script's WRONGTYPE error becomes the error naming what each key holds."""
        try:
            yield
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            raise wrong_type_error(client, self._types(), e) from e

    def _types(self) -> dict[str, str]:
        """The Redis type batchq keeps under each key the claim and resume touch."""
        return self.base_keys.types(
            "meta", "incarnation", "data", "work", "wake", "failures", "ledger"
        )

    def acquire(
        self, takeover: str = "", client: redis.Redis | None = None, *, resuming: bool = False
    ) -> bool:
        """Claim the queue; True if that started a new run.

        Args:
            takeover: a run id: take the claim over even while another trainer's claim
                is live, if the queue still runs that run (resuming a checkpoint).
            client: the calling thread's client (the reader's own; default the
                stream's).
            resuming: a :meth:`resume` follows (which publishes; see ``publish``).

        Raises:
            TrainerConflict: another trainer's claim is live.
        """
        self.checkpoint_run = takeover
        run = new_run_id()  # the same on a retry: claim.lua knows its own try
        client = client or self.client
        reply: ClaimReply = self._retry(
            lambda: self._claim(client, "acquire", takeover, run), "claiming", client
        )
        if reply.status == Status.CONFLICT and self._holder_died(client, reply.holder):
            # Its process died (a crash, a kill): no need to wait for its claim to lapse.
            holder = reply.holder
            reply = self._retry(
                lambda: self._claim(client, "acquire", takeover, run, dead=holder),
                "claiming",
                client,
            )
        self._check_acquired(reply)
        if reply.retired >= 0:
            self._drain_slot(client, reply.retired)
        with self._lock:
            self.incarnation, self.run, self.held = reply.incarnation, reply.run, reply.held
            self._use_slot(reply.slot, reply.groups)
        self.claimed = True
        if not resuming:
            self._published(client)
        return reply.new_run

    def awaits_resume(self, client: redis.Redis) -> bool:
        """Whether this rank's slot is done until a resume puts its cursors in place:
        claim.lua marks a new slot's ranks so where it took the slot over for a resume
        (nothing is minted for them before)."""
        field = f"{MetaField.DONE}{self.suffix}"
        done = self._retry(lambda: client.hget(self.keys.meta, field), "reading", client)
        return bool(done == b"1")

    def _holder_died(self, client: redis.Redis, holder: str) -> bool:
        """Whether the claim's holder has no connection open: its process died. A holder
        that named none (an older trainer, a server refusing CLIENT SETNAME) or a server
        refusing CLIENT LIST leaves it to the claim's lapse."""
        if not holder:
            return False
        names = self._retry(lambda: connected_names(client), "listing clients", client)
        if names is None or holder in names:
            return False
        log.info("%s: its holder has no connection open (it died): claim taken", self.what)
        return True

    def _drain_slot(self, client: redis.Redis, slot: int) -> None:
        """Let go of what the lists of group slot ``slot`` hold: this group read it with
        another number of ranks and came back with this one (claim.lua retired it)."""
        if self._drain is None:
            return
        field = reader_field(MetaField.WORLD, slot)
        world = as_int(client.hget(self.base_keys.meta, field)) or 1
        view = self.base_keys.slot_view(slot)
        for r in range(world):
            self._drain(view, view.data_of(r, world))

    def _check_acquired(self, reply: ClaimReply) -> None:
        """Raise what a refused acquire means."""
        if reply.status == Status.CONFLICT:
            raise self._conflict(reply.value)
        if reply.status == Status.WORLD and self.grouped:
            raise GroupWorldMismatch(self.base_keys.queue, self.group, reply.value, self.world)
        if reply.status == Status.WORLD:
            raise WorldSizeMismatch(self.keys.queue, reply.value, self.world)
        if reply.status == Status.FULL:
            raise TooManyGroups(
                f"queue {self.base_keys.queue}: its run is read by {reply.value} groups, the "
                f"most a run has ({MAX_GROUPS}); group {self.group!r} cannot join it"
            )
        if reply.status != Status.OK:
            raise status_error(reply.status, self.what)

    def _conflict(self, lapse_ms: int) -> TrainerConflict:
        """The error of an acquire refused while another trainer's claim lapses in
        ``lapse_ms`` (a group's names the group; a single trainer's, its rank)."""
        rank = f" as rank {self.rank}" if self.world > 1 else ""
        held = f"{self.what} is held" if self.grouped else f"queue {self.keys.queue} is held{rank}"
        return TrainerConflict(
            f"{held} by another trainer (its claim lapses in {lapse_ms / 1000:.1f} s "
            f"unless it is alive); use another {'group' if self.grouped else 'queue'}, or "
            f"resume its run with load_state_dict{rank_hint(self.world)}"
        )

    def _use_slot(self, slot: int, groups: int) -> None:
        """Read group slot ``slot`` of a run of ``groups`` slots (0: not read by several
        groups); under the lock."""
        self.slot, self.groups = slot, groups
        self.grouped = groups > 0 or self.group != ""
        self.keys = self.base_keys.slot_view(slot)
        self.data_key = self.keys.data_of(self.rank, self.world)
        self.suffix = reader_field("", slot, self.rank, self.world)

    def _published(self, client: redis.Redis) -> None:
        """Publish this trainer's host (after an acquire or a resume), retried as the
        claim is: a connection lost right after the claim must not end the start."""
        publish = self._publish
        if publish is not None:
            slot = self.slot
            self._retry(lambda: publish(client, slot), "publishing the host", client)

    def reclaim(self, client: redis.Redis) -> None:
        """Claim the queue again after Redis lost its state, a :meth:`resume` to follow
        (the reader thread re-creates the run from what the trainer has received).

        Every rank of a job (and every group) recovers into the same run, named after the
        new incarnation.
        """
        self.resume_run = ""
        self.acquire(client=client, resuming=True)
        if self.world > 1 or self.grouped:
            self.resume_run = lost_run_id(self.incarnation)

    def use_plan(self, meta: dict[bytes, bytes]) -> Plan | None:
        """Take the run's plan from the queue's meta as read (None where no producer has
        published one yet: :meth:`wait_for_plan` then waits for it)."""
        plan = Plan(meta) if MetaField.SHARDS.encode() in meta else None
        with self._lock:
            self.plan = plan
        return plan

    def refresh(self, client: redis.Redis) -> None:
        """Keep the claim alive (the reader calls this while its buffer is full).

        Raises:
            TrainerConflict: the claim was taken over.
            StateLost: there is no claim because Redis lost the queue.
        """
        # STATE_LOST (Redis lost the queue, perhaps re-made since by a producer) is not
        # a takeover: callers claim again or re-create the run (claim.lua compares the
        # incarnation the claim was made in).
        status = self._claim(client, "refresh").status
        if status != Status.OK:
            raise status_error(status, self.what)

    def release(self, finished: bool) -> bool:
        """Give the claim up; with ``finished`` this rank of the group is done, and the
        run ends (producers exit) once every rank of every group is.

        Returns:
            True if the run ended (this was its last rank to finish).

        Raises:
            StateLost: ``finished``, and Redis lost the queue (restarted empty) since
                the claim: the finish reached no run, and the producers serve on until
                one is finished (the caller claims the queue again to finish it).
        """
        if not self.claimed:
            return False
        op: ClaimOp = "finish" if finished else "release"
        reply: ClaimReply = self._retry(lambda: self._claim(self.client, op), f"{op} of the claim")
        self.claimed = False
        if reply.status == Status.STATE_LOST and finished:
            raise status_error(reply.status, self.what)
        if reply.status != Status.OK:  # taken over, or lost with the queue: nothing to give up
            log.warning("%s: the claim was gone at its %s (%s)", self.what, op, reply.status)
        return finished and reply.run_done

    def wait_for_plan(self, timeout_s: float, block_s: float) -> Plan:
        """Wait (bounded) until a producer has published the run's plan (S and hwm),
        keeping the claim meanwhile (:func:`consumer.plan.wait_for_plan`).

        Raises:
            ProducersLost: no producer joined within timeout_s.
            RunChanged: another run replaced the claimed one meanwhile (but the one the
                job's ranks resume into: another rank resumed first, and this one's
                resume joins it).
        """
        joined = False  # the run is the job's resumed one: this rank's claim went with it

        def read() -> dict[bytes, bytes]:
            nonlocal joined
            meta: dict[bytes, bytes] = self._retry(
                lambda: self.client.hgetall(self.keys.meta), "reading the plan"
            )
            inc = self._retry(lambda: self.client.get(self.keys.incarnation), "reading the plan")
            run = meta.get(MetaField.RUN.encode(), b"").decode()
            if not run or (inc or b"").decode() != self.incarnation:
                # Redis restarted empty (or the queue was reset) before any producer
                # joined: nothing was popped, so claiming afresh loses nothing.
                log.warning(
                    "queue %s: the queue's state is gone; claiming it again", self.keys.queue
                )
                self.acquire()
                return {}
            joined = run != self.run and run == self.resume_run != ""
            if run != self.run and not joined:
                raise RunChanged(f"queue {self.keys.queue}: the run changed while starting")
            return meta

        # join.lua's tokens for every group's waiting ranks go to the run's wake list; a
        # group slot's own (its pops' wake-ups) is watched too.
        lists = list(dict.fromkeys([self.keys.wake, self.base_keys.wake]))

        def idle() -> None:
            try:
                if not joined:  # else nothing to keep: this rank's resume claims again
                    self._retry(lambda: self.refresh(self.client), "refreshing the claim")
            except StateLost:
                return  # emptied during the refresh: read() claims again
            self._retry(lambda: self.client.blpop(lists, timeout=block_s), "waiting for the plan")

        plan = wait_for_plan(read, idle, timeout_s, queue=self.keys.queue)
        with self._lock:
            self.plan = plan
        return plan

    def resume(
        self,
        client: redis.Redis,
        first_shard: int,
        fingerprint: str,
        ledger: Iterable[tuple[str, str]],
        *,
        step: int = 0,
        shards: int | None = None,
        remap: tuple[int, dict[int, int]] | None = None,
        keep: str = "",
    ) -> None:
        """Restart the plan at ``first_shard`` under a new run id.

        The data, work and failure lists are dropped; the producers join the new run
        and build only what the ledger does not mark as had. The ranks of a job resume
        into one run, :attr:`resume_run` (set before :meth:`acquire`): the first
        creates it, the others join it. A single trainer (:attr:`can_keep`) whose
        checkpoint is where its run's trainer detached (``keep``, the state's digest)
        takes that run over as it is instead: its list holds every batch not yielded.

        Args:
            client: the client to use.
            first_shard: epoch * S of the epoch to resume (a rank: epoch * P).
            fingerprint: the pipeline the run must be served by.
            ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
            step: the batches yielded at the checkpoint (ranks must agree).
            shards: S, when no producer published it (from the checkpoint).
            remap: (epoch, slot -> shard): that epoch's slots build these shards (a job
                resumed with another number of ranks).
            keep: the state's :func:`~consumer.checkpoint.position_digest` ('' where the
                queue is striped: its stripes resume each from its own pairs).

        Raises:
            StepMismatch: another rank of the job resumed from another step.
        """
        asked = Restart(
            first_shard, fingerprint, list(ledger), step,
            resumed_shape(self.plan, fingerprint, shards), remap, keep if self.can_keep else "",
        )  # fmt: skip
        with self._typed_errors(client):
            self._restart(client, asked)
        self.remap, self.remap_done = remap, past_remap(asked.ledger, remap)
        self._published(client)
        log.info("%s: resumed at shard %d in run %s", self.what, first_shard, self.run)

    def _restart(self, client: redis.Redis, asked: Restart) -> None:
        """resume.lua, retried; the session reads the run (and the slot) it answers.

        Raises:
            StepMismatch: another rank of the job (the group) resumed from another step.
        """
        ranked = self.world > 1 or self.grouped  # the ranks (groups) resume into one run
        run = self.resume_run if ranked and self.resume_run else new_run_id()
        shape = asked.shape

        def call() -> ResumeReply:
            # A run of several groups has no params log (set_params is refused there).
            if self._before_resume is not None and not self.grouped:
                self._before_resume(client, self, run)
            for _ in range(_GROUPS_TRIES):
                self._read_shape(client)
                reply = resume(
                    client, self.base_keys, ResumeArgs(
                        token=self.token, new_run=run, takeover_run=self.checkpoint_run,
                        first=asked.first_shard, fingerprint=asked.fingerprint,
                        hwm=shape.list_cap or "", shards=shape.shards, window=shape.window,
                        epoch_batches=shape.epoch_batches, group=self.group, rank=self.rank,
                        world=self.world, even=self.even, step=asked.step, held=self.held,
                        slot=self.slot, acquired=self.run, claim_ttl_ms=self.claim_ttl_ms,
                        keep=asked.keep,
                    ),
                    groups=self.groups, key_world=self._key_world, remap=asked.remap,
                    ledger=asked.ledger,
                )  # fmt: skip
                if reply.status != Status.GROUPS:
                    return reply
            raise ProtocolError(f"{self.what}: the run's groups kept changing while resuming")

        reply: ResumeReply = self._retry(call, "resuming", client)
        if reply.status == Status.STEP:
            raise StepMismatch(
                f"{self.what}: resumed from a state at step {asked.step}, but the "
                f"{'group' if self.grouped else 'job'}'s other ranks resumed from step "
                f"{reply.text}; expected the states of one checkpoint"
            )
        if reply.status != Status.OK:
            raise TrainerConflict(f"{self.what}: the claim was lost while resuming")
        with self._lock:
            self.run = reply.run
            self._use_slot(reply.slot, reply.groups)
