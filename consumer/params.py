"""The trainer's side of the run's params log: ``set_params``, the frames it checks, the
shards it has built again, and what goes into a checkpoint.

One :class:`StreamParams` per stream. It keeps the run's change log
(:mod:`batchq.protocol.params_log`) as the trainer knows it: every change goes through
params.lua (which gives it its version and returns the whole log, another rank's
changes included), a checkpoint carries it, and a resume writes it back before the
resumed run exists (:meth:`load`, the session's hook before resume.lua).

Where a change applies (``set_params``, :func:`change_index`): at ``at_batch``,
at ``at_epoch``'s first batch, or by default at the trainer's position plus the run's
look-ahead D (:func:`batchq.protocol.ranks.lookahead_batches`), the first index no
producer can have built yet. D depends on the plan alone, so a loop that makes the same
call at the same step gets the same index, resumed or not. An index before the position
is a ConfigError.

A frame whose params version is not the one the log gives its index is never yielded:
it is dropped on arrival (:meth:`StreamParams.screen`, the reader thread's filer) or, where a
change makes frames already held stale, at the change (the buffer is purged, under the
same lock as a reader round's filing). Each such shard goes back to the front of the
work list with the batches the trainer keeps of it (params.lua's rebuild, which
lease.lua's skip reads), once per shard and log version; the frames dropped are counted
(``rebuilt_params``).

A striped queue (:mod:`batchq.protocol.stripes`) has a log per stripe, which its
producers follow: stripe 0's gives the versions (params.lua's add), and each change is
copied into every other stripe's (params.lua's load). The index is the plan's, as a
stripe's producers count it, so an entry applies at the same batch in every stripe; D
counts the N x W shards the stripes mint ahead. Every stripe's reader screens its
frames; a shard goes back to be built again in its stripe's numbers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import redis

from batchq.client.connection import retrying
from batchq.errors import ConfigError, ProtocolError, StateLost, TrainerConflict
from batchq.protocol import params_scripts
from batchq.protocol.fields import MetaField
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES, ledger_field
from batchq.protocol.params_log import (
    EMPTY_PARAMS,
    ParamsLog,
    check_params,
    dump_params,
    merged,
)
from batchq.protocol.ranks import BatchNumbering, RankLayout, frame_index
from batchq.protocol.stripes import Stripes
from batchq.protocol.words import Status, status_error
from batchq.wire.codec import Frame
from consumer.plan import ReaderBuffer
from consumer.reader.filing import Decoded
from consumer.session import Session

__all__ = ["StreamParams", "change_index", "positions", "refuse_grouped"]

log = logging.getLogger(__name__)

_WAIT_S = 0.05  # polling for a plan's figure, or for the reader's recovery


class StreamParams:
    """A stream's params log and what it does with it.

    Args:
        log: the log to start from (a checkpoint's; empty for a new stream).
    """

    def __init__(self, log: ParamsLog | None = None) -> None:
        self.log = log or ParamsLog()
        self._lock = threading.Lock()  # the log is replaced by both threads
        # A reader round's screening and filing against a change's new log and purge:
        # a frame is either filed before the purge (and purged) or screened after it.
        self.filing = threading.Lock()
        self._session: Session | None = None
        self._stripes: list[Session] = []  # a striped queue's sessions, stripe 0's first
        self._layout: RankLayout | None = None
        self._numbering: BatchNumbering | None = None
        self._last: Frame | None = None  # the frame yielded last
        self._pending: dict[tuple[int, int], int] = {}  # (epoch, shard) -> frames dropped
        self._asked: set[tuple[int, int]] = set()  # (global slot, log version) rebuilt
        self._unsent = 0  # frames dropped not yet counted in the queue's stats
        self.rebuilt = 0  # frames dropped: built with params since changed

    # -- the run ------------------------------------------------------------------------

    def bind(
        self, session: Session, layout: RankLayout, others: list[Session] | None = None
    ) -> None:
        """Reading started: the session (run, claim, plan), this rank's split, and a
        striped queue's other stripes' sessions (stripe 1's first)."""
        self._session, self._layout = session, layout
        self._stripes = [session, *(others or [])]

    def _take(self, log: ParamsLog) -> None:
        """Merge a log read from Redis (the run's, a prefix or an extension of ours)."""
        with self._lock:
            self.log = merged(self.log, log)

    def load(self, client: redis.Redis, session: Session, run: str) -> None:
        """Write this log as ``run``'s (before resume.lua creates it: the session's hook;
        a longer log of it there is kept) and take what is stored."""
        log_ = self.log
        reply = params_scripts.params(
            client, session.keys, op="load", incarnation=session.incarnation, run=run,
            token=session.token, suffix=session.suffix, index=len(log_),
            body=log_.entries_json(),
        )  # fmt: skip
        if reply.status == Status.TOO_BIG:
            raise ConfigError(f"the params log of {reply.size} bytes passes its cap")
        if reply.status != Status.OK:
            raise status_error(reply.status, session.what)
        self._take(ParamsLog.from_stored(reply.log, run))

    def refresh(self, client: redis.Redis) -> None:
        """Read the run's log (another rank changed it) and take it."""
        session = self._session
        if session is None:
            return
        if len(self._stripes) > 1:  # stripe 0's log has every version first
            client = session.client
        raw = client.getrange(session.keys.params, 0, PARAMS_LOG_MAX_BYTES + 64)
        try:
            self._take(ParamsLog.from_stored(raw, session.run))
        except ConfigError as e:
            log.warning("%s: the stored params log was not read: %s", session.what, e)

    def numbering(self, client: redis.Redis) -> BatchNumbering:
        """The run's batch numbering (its plan's B is waited for, bounded, where no
        producer has published it yet).

        Raises:
            ProtocolError: still unknown after the stream's timeout_s.
        """
        if self._numbering is not None:
            return self._numbering
        session, layout = self._session, self._layout
        if session is None or layout is None:
            raise ProtocolError("the stream's params are used before reading started")
        deadline = time.monotonic() + session.retry_s
        plan = session.plan
        stride = plan.shard_batches if plan is not None else -1
        while stride < 0:
            raw = session.client.hget(session.keys.meta, MetaField.SHARD_BATCHES)
            stride = int(raw) if raw is not None and raw.isdigit() else -1
            if stride < 0 and time.monotonic() > deadline:
                raise ProtocolError(
                    f"{session.what}: no producer published the plan's batches per shard"
                )
            if stride < 0:
                time.sleep(_WAIT_S)
        window = plan.window * plan.stripes if plan is not None else 1  # N x W minted ahead
        self._numbering = BatchNumbering(layout, stride, window)
        return self._numbering

    # -- set_params ---------------------------------------------------------------------

    def set_params(
        self,
        update: Any,
        at_batch: Any,
        at_epoch: Any,
        *,
        buffer: ReaderBuffer,
        consumed: tuple[int, dict[int, int], list[int]],
        step: int,
    ) -> int:
        """Record a change of the producers' params; returns the global batch index from
        which it applies (see the module docstring).

        Args:
            update: the params to merge over those in effect (a JSON mapping).
            at_batch, at_epoch: where it applies (None, None: the default).
            buffer: the stream's buffer (frames held that the change makes stale go).
            consumed: where the caller is (the buffer's ``consumed``, less what a
                wrapper holds back).
            step: batches the caller has had since the job began (names the call).

        Raises:
            ConfigError: a bad argument, or an index before the trainer's position.
        """
        plain = check_params(update)
        session = self._session
        if session is None:
            raise ProtocolError("set_params before reading started")
        client = session.client
        numbering = self.numbering(client)
        rank = session.rank
        position, past = positions(numbering, consumed, rank)
        index = change_index(numbering, at_batch, at_epoch, position, past)
        call_id = hashlib.sha1(
            f"{step}:{at_batch}:{at_epoch}:{dump_params(plain)}".encode()
        ).hexdigest()[:20]
        stored = self._add(session, index, dump_params(plain), call_id)
        for stripe in self._stripes[1:]:  # every stripe's producers follow the change
            self._copy(stripe, stored)
        with self.filing:
            self._take(stored)
            rows = self._drop_stale(client, buffer)
        entry = self.log.find(call_id)
        if entry is None:
            raise ProtocolError(f"{session.what}: params.lua did not record the change")
        if rows:
            self._rebuild(client, session, rows)
        log.info(
            "%s: params %s from batch %d (version %d)", session.what, plain, entry.index,
            entry.version,
        )  # fmt: skip
        return entry.index

    def _add(self, session: Session, index: int, body: str, call_id: str) -> ParamsLog:
        """params.lua's add, through a drop of the connection and through the reader's
        recovery of a run Redis lost (the log is re-created with the run)."""
        deadline = time.monotonic() + session.retry_s
        while True:
            run = session.run
            call = functools.partial(
                params_scripts.params, session.client, session.keys, op="add",
                incarnation=session.incarnation, run=run, token=session.token,
                suffix=session.suffix, index=index, body=body, call_id=call_id,
            )  # fmt: skip
            reply = retrying(call, f"recording params ({session.what})", session.retry_s)
            if reply.status == Status.OK:
                return ParamsLog.from_stored(reply.log, run)
            if reply.status == Status.TOO_BIG:
                raise ConfigError(
                    f"the params log would take {reply.size} bytes as JSON: expected at "
                    f"most {PARAMS_LOG_MAX_BYTES} (fewer or smaller set_params calls)"
                )
            if reply.status == Status.CLAIM_LOST:
                raise TrainerConflict(f"{session.what}: the claim was lost")
            if reply.status not in (Status.STATE_LOST, Status.RUN_CHANGED):
                raise status_error(reply.status, session.what)
            # Redis lost the queue: the reader re-creates the run (with this log).
            while session.run == run and time.monotonic() < deadline:
                time.sleep(_WAIT_S)
            if session.run == run:
                raise StateLost(f"{session.what}: Redis lost the queue while set_params ran")

    def _copy(self, stripe: Session, stored: ParamsLog) -> None:
        """Write stripe 0's log (``stored``) as another stripe's, for its run (params.lua's
        load; a stripe whose Redis lost its run gets it with the run its reader
        re-creates, the session's hook)."""
        call = functools.partial(
            params_scripts.params, stripe.client, stripe.keys, op="load",
            incarnation=stripe.incarnation, run=stripe.run, token=stripe.token,
            suffix=stripe.suffix, index=len(stored), body=stored.entries_json(),
        )  # fmt: skip
        reply = retrying(call, f"recording params ({stripe.what})", stripe.retry_s)
        if reply.status == Status.CLAIM_LOST:
            raise TrainerConflict(f"{stripe.what}: the claim was lost")
        if reply.status not in (Status.OK, Status.STATE_LOST):
            raise status_error(reply.status, stripe.what)

    # -- frames -------------------------------------------------------------------------

    def _stale(self, numbering: BatchNumbering, epoch: int, frame: Frame) -> bool:
        """Whether a frame (a rank's: local shard) was built with another version than
        the log's at its index."""
        if self._layout is None:
            return False
        local = epoch * self._layout.per_rank + frame.shard
        g = self._layout.to_global(local, self._session.rank if self._session else 0)
        index = frame_index(g, frame.k, numbering.stride)
        return self.log.version_at(index) != frame.params_version

    def screen(self, decoded: Decoded, client: redis.Redis, buffer: ReaderBuffer) -> Decoded:
        """A reader round's frames less those built with stale params (the reader
        thread, under :attr:`filing`: the filer holds this log as its screen,
        :class:`consumer.reader.filing.FrameScreen`); their shards are noted, for
        :meth:`send_rebuilds` after the filing.

        A frame of a version this log does not have yet (another rank's change) reads
        the log first, and what the buffer holds that the change made stale goes too.
        """
        frames = decoded.frames
        if not frames or (not self.log and not any(f.params_version for f, _ in frames)):
            return decoded
        if any(f.params_version > self.log.version for f, _ in frames):
            known = self.log.version
            self.refresh(client)
            if self.log.version > known:
                for epoch, shard, _, dropped in self._drop_stale(client, buffer):
                    self._pending[epoch, shard] = self._pending.get((epoch, shard), 0) + dropped
        numbering = self.numbering(client)
        kept = []
        for frame, raw in frames:
            if self._stale(numbering, frame.epoch, frame):
                key = (frame.epoch, frame.shard)
                self._pending[key] = self._pending.get(key, 0) + 1
            else:
                kept.append((frame, raw))
        return Decoded(kept, decoded.stale)

    def send_rebuilds(self, client: redis.Redis, buffer: ReaderBuffer) -> None:
        """Hand the shards noted by :meth:`screen` back (reader thread)."""
        if not self._pending or self._session is None:
            return
        with self.filing:  # the stripes' readers screen into it
            pending, self._pending = self._pending, {}
        rows = [(e, s, buffer.prefix(e, s), n) for (e, s), n in pending.items()]
        self._rebuild(client, self._session, rows)

    def _drop_stale(
        self, client: redis.Redis, buffer: ReaderBuffer
    ) -> list[tuple[int, int, int, int]]:
        """Drop what the buffer holds that the log says is stale (its ``purge``)."""
        numbering = self.numbering(client)
        return buffer.purge(lambda epoch, frame: self._stale(numbering, epoch, frame))

    def _rebuild(
        self, client: redis.Redis, session: Session, rows: list[tuple[int, int, int, int]]
    ) -> None:
        """params.lua's rebuild for (epoch, local shard, kept, frames dropped) rows (a
        striped queue's in each row's stripe, in its numbers)."""
        layout = self._layout
        if layout is None:
            return
        version = self.log.version
        stripes = Stripes(len(self._stripes) or 1)
        shards: dict[int, list[params_scripts.Rebuild]] = {}
        with self._lock:  # both threads rebuild: the training thread's change, the reader
            if any(v != version for _, v in self._asked):  # older versions never come again
                self._asked = {key for key in self._asked if key[1] == version}
            for epoch, shard, kept, dropped in sorted(rows):
                self.rebuilt += dropped
                self._unsent += dropped
                g = layout.to_global(epoch * layout.per_rank + shard, session.rank)
                if (g, version) in self._asked:
                    continue
                self._asked.add((g, version))
                k, m = stripes.of(epoch * layout.per_rank + shard)
                m_epoch, j = divmod(m, layout.per_rank)
                field = ledger_field(m_epoch, layout.slot(j, session.rank))
                g = layout.to_global(m, session.rank)  # the stripe's (g itself unstriped)
                shards.setdefault(k, []).append(params_scripts.Rebuild(field, kept, g))
            dropped_now, self._unsent = self._unsent, 0
        for k in sorted(shards) or [0]:
            stripe = self._stripes[k] if stripes.striped else session
            reply = params_scripts.params(
                stripe.client if stripes.striped else client, stripe.keys, op="rebuild",
                incarnation=stripe.incarnation, run=stripe.run, token=stripe.token,
                suffix=stripe.suffix, index=dropped_now, rebuild=shards.get(k, []),
            )  # fmt: skip
            dropped_now = 0  # counted once, in the first stripe's stats
            if reply.status != Status.OK:
                raise status_error(reply.status, stripe.what)
        if shards:
            log.info(
                "%s: %d shard(s) built with params since changed go back to be built again",
                session.what,
                sum(len(v) for v in shards.values()),
            )

    # -- what was yielded ---------------------------------------------------------------

    def track(self, frames: Iterator[Frame]) -> Iterator[Frame]:
        """``frames``, remembering the last one (whose params :meth:`params` gives)."""
        for frame in frames:
            self._last = frame
            yield frame

    def params_of(self, frame: Frame | None, client: redis.Redis) -> Mapping[str, Any]:
        """The params ``frame`` was built with (read-only; empty before any change)."""
        if frame is None or not self.log or self._layout is None or self._session is None:
            return EMPTY_PARAMS
        numbering = self.numbering(client)
        local = frame.epoch * self._layout.per_rank + frame.shard
        g = self._layout.to_global(local, self._session.rank)
        return self.log.params_at(frame_index(g, frame.k, numbering.stride))

    def last_params(self, client: redis.Redis) -> Mapping[str, Any]:
        """The params of the batch yielded last."""
        return self.params_of(self._last, client)

    def state(self) -> list[dict[str, Any]] | None:
        """The log for a checkpoint (None when empty: the state stays as it was)."""
        return self.log.to_json() if self.log else None


def refuse_grouped(session: Session | None) -> None:
    """``set_params`` is not for a run read by several groups: one build serves every
    group, so no group may steer the producers for itself.

    Raises:
        ConfigError: the session reads a group of such a run.
    """
    if session is not None and session.grouped:
        raise ConfigError(
            f"{session.what}: set_params changes what the producers build for every group "
            "of the run (each batch is built once for all): not supported in a run read by "
            "several groups"
        )


def positions(
    numbering: BatchNumbering, consumed: tuple[int, Mapping[int, int], list[int]], rank: int
) -> tuple[int, int]:
    """(position, past) of a trainer whose ledger says ``consumed`` (epoch, local shard
    -> batches handed out, local shards handed out completely).

    ``position`` is :meth:`BatchNumbering.position` of its first local shard not handed
    out completely (its next batch in plan order); ``past`` is one more than the largest
    index it handed out (in arrival order it may have handed out batches beyond its
    position; at most ``position`` in plan order).
    """
    epoch, counts, done = consumed
    per_rank = numbering.layout.per_rank
    finished = set(done)
    first = next((s for s in range(per_rank) if s not in finished), per_rank)
    position = numbering.position(epoch * per_rank + first, counts.get(first, 0))
    past = 0
    for shard, n in counts.items():
        if n > 0:
            last = numbering.local_index(epoch * per_rank + shard, n - 1, rank)
            past = max(past, last + 1)
    return position, past


def change_index(
    numbering: BatchNumbering, at_batch: Any, at_epoch: Any, position: int, past: int
) -> int:
    """The index a change applies from: at_batch, at_epoch's first, or the default."""
    if at_batch is not None and at_epoch is not None:
        raise ConfigError(f"at_batch={at_batch!r} and at_epoch={at_epoch!r}: expected at most one")
    for name, value in (("at_batch", at_batch), ("at_epoch", at_epoch)):
        if value is not None and (type(value) is not int or value < 0):
            raise ConfigError(f"{name} {value!r} is not valid: expected an integer >= 0")
    first = max(position, past)
    if at_batch is not None:
        index, what = int(at_batch), f"at_batch {at_batch}"
    elif at_epoch is not None:
        index, what = numbering.epoch_first(at_epoch), f"at_epoch {at_epoch} (batch "
        what += f"{numbering.epoch_first(at_epoch)})"
    else:
        return max(position + numbering.lookahead, past)
    if index < first:
        raise ConfigError(
            f"{what} is in the past: the trainer has handed out batches up to index "
            f"{first - 1}; expected an index >= {first}"
        )
    return index
