"""The trainer's hold on a queue: its claim, the run it reads, and restarting the plan.

One object per ServerDataStream, shared by the stream (start, close) and its reader
thread (refresh, recovery after Redis lost the queue's state). Every call is one script.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import redis

from batchq.connection import is_wrong_type, retrying, wrong_type_error
from batchq.errors import (
    ProducersLost,
    RunChanged,
    StepMismatch,
    TrainerConflict,
    WorldSizeMismatch,
)
from batchq.keys import QueueKeys
from batchq.protocol import PROTOCOL_VERSION, Status, decode_reply
from batchq.ranks import RankLayout
from batchq.scripts import SCRIPTS

__all__ = ["Plan", "Session"]

log = logging.getLogger(__name__)


class Plan:
    """What the producers published about the run: enough to re-create it."""

    def __init__(self, meta: dict[bytes, bytes]) -> None:
        def get(name: str, default: str = "") -> str:
            return meta.get(name.encode(), default.encode()).decode()

        self.fingerprint = get("fingerprint")
        self.hwm = get("hwm")
        self.shards = int(get("shards", "0"))
        self.window = int(get("window", "1"))
        self.has_window = b"window" in meta  # published by the run's first producer
        self.epoch_batches = int(get("epoch_batches", "-1"))
        self.world = int(get("world", "1"))
        self.even = get("even", "pad")


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
        even: how ranks get equal counts, 'pad' or 'drop' (see :mod:`batchq.ranks`).
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
    ) -> None:
        self.client = client
        self.retry_s = retry_s
        self.keys = keys
        self.claim_ttl_ms = claim_ttl_ms
        self.token = uuid.uuid4().hex
        self.incarnation = ""
        self.run = ""
        self.plan: Plan | None = None
        self.claimed = False
        self.rank, self.world, self.even = rank, world, even
        # A rank's meta fields end in ':<rank>' (world 1: nothing), see batchq/ranks.py.
        self.suffix = "" if world == 1 else f":{rank}"
        self.data_key = keys.data_of(rank, world)
        self.held = False  # this rank had claimed the run before (a second resume)
        self.resume_run = ""  # the run id the job's ranks resume into (see resume)

    @property
    def what(self) -> str:
        """'queue Q' or 'queue Q rank r', for messages."""
        rank = f" rank {self.rank}" if self.world > 1 else ""
        return f"queue {self.keys.queue}{rank}"

    def layout(self, shards: int) -> RankLayout:
        """This job's split of a plan of ``shards`` shards among its ranks."""
        return RankLayout(shards, self.world, self.even)

    def _data_lists(self) -> list[str]:
        # Every rank's list (of this world, and of the one before if larger) and the
        # ranks' counts: a new run drops them all.
        world = self.world
        with contextlib.suppress(redis.RedisError, ValueError):  # this world's, at least
            world = max(world, int(self.client.hget(self.keys.meta, "world") or 1))
        if world == 1:
            return []
        return [*self.keys.rank_data(world), self.keys.counts, self.keys.remap]

    def _keys(self) -> list[str]:
        k = self.keys
        return [k.meta, k.incarnation, k.data, k.work, k.wake, k.failures, k.ledger]

    def _retry(self, fn: Any, what: str) -> Any:
        return retrying(fn, f"{what} (queue {self.keys.queue})", self.retry_s, client=self.client)

    def _claim(self, client: redis.Redis, op: str, takeover: str = "", run: str = "") -> list[Any]:
        args: list[Any] = [
            self.token,
            self.claim_ttl_ms,
            op,
            run or uuid.uuid4().hex[:16],
            uuid.uuid4().hex,
            takeover,
            PROTOCOL_VERSION,
            self.rank,
            self.world,
            self.even,
            self.resume_run,
        ]
        keys = self._keys() + (self._data_lists() if op in ("acquire", "finish") else [])
        try:
            return decode_reply(SCRIPTS["claim"](client, keys, args))
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            raise wrong_type_error(client, self._types(), e) from e

    def _types(self) -> dict[str, str]:
        """The Redis type batchq keeps under each key the claim and resume touch."""
        k = self.keys
        return {
            k.meta: "hash", k.incarnation: "string", k.data: "list", k.work: "list",
            k.wake: "list", k.failures: "hash", k.ledger: "hash",
        }  # fmt: skip

    def acquire(self, takeover: str = "") -> bool:
        """Claim the queue; True if that started a new run.

        Args:
            takeover: a run id: take the claim over even while another trainer's claim
                is live, if the queue still runs that run (resuming a checkpoint).

        Raises:
            TrainerConflict: another trainer's claim is live.
        """
        run = uuid.uuid4().hex[:16]  # the same on a retry: claim.lua knows its own try
        reply = self._retry(lambda: self._claim(self.client, "acquire", takeover, run), "claiming")
        if reply[0] == Status.CONFLICT:
            rank = f" as rank {self.rank}" if self.world > 1 else ""
            raise TrainerConflict(
                f"queue {self.keys.queue} is held{rank} by another trainer (its claim lapses "
                f"in {int(reply[1]) / 1000:.1f} s unless it is alive); use another queue, or "
                "resume its run with load_state_dict"
            )
        if reply[0] == Status.WORLD:
            raise WorldSizeMismatch(self.keys.queue, int(reply[1]), self.world)
        self.incarnation, self.run = reply[1], reply[2]
        self.held = len(reply) > 5 and bool(int(reply[5]))
        self.claimed = True
        return bool(int(reply[3]))

    def refresh(self, client: redis.Redis) -> None:
        """Keep the claim alive (the reader calls this while its buffer is full).

        Raises:
            TrainerConflict: the claim was taken over.
        """
        if self._claim(client, "refresh")[0] != Status.OK:
            raise TrainerConflict(f"{self.what}: this trainer's claim was taken over by another")

    def release(self, finished: bool) -> bool:
        """Give the claim up; with ``finished`` the run ends and producers exit (a rank:
        once every rank finished).

        Returns:
            True if the run ended (this was its last rank to finish).
        """
        if not self.claimed:
            return False
        op = "finish" if finished else "release"
        reply = self._retry(lambda: self._claim(self.client, op), f"{op} of the claim")
        self.claimed = False
        if not finished:
            return False
        return len(reply) < 2 or bool(int(reply[1]))

    def wait_for_plan(self, timeout_s: float, block_s: float) -> Plan:
        """Wait (bounded) until a producer has published the run's plan (S and hwm).

        Raises:
            ProducersLost: no producer joined within timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            meta: dict[bytes, bytes] = self._retry(
                lambda: self.client.hgetall(self.keys.meta), "reading the plan"
            )
            inc = self._retry(lambda: self.client.get(self.keys.incarnation), "reading the plan")
            run = meta.get(b"run", b"").decode()
            if not run or (inc or b"").decode() != self.incarnation:
                # Redis restarted empty (or the queue was reset) before any producer
                # joined: nothing was popped, so claiming afresh loses nothing.
                log.warning(
                    "queue %s: the queue's state is gone; claiming it again", self.keys.queue
                )
                self.acquire()
                continue
            if run != self.run:
                raise RunChanged(f"queue {self.keys.queue}: the run changed while starting")
            if b"shards" in meta:
                self.plan = Plan(meta)
                return self.plan
            if time.monotonic() > deadline:
                raise ProducersLost(0, [], timeout_s)
            self._retry(lambda: self.refresh(self.client), "refreshing the claim")
            self._retry(
                lambda: self.client.blpop([self.keys.wake], timeout=block_s),
                "waiting for the plan",
            )

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
    ) -> None:
        """Restart the plan at ``first_shard`` under a new run id.

        The data, work and failure lists are dropped; the producers join the new run
        and build only what the ledger does not mark as had. The ranks of a job resume
        into one run, :attr:`resume_run` (set before :meth:`acquire`): the first
        creates it, the others join it.

        Args:
            client: the client to use.
            first_shard: epoch * S of the epoch to resume (a rank: epoch * P).
            fingerprint: the pipeline the run must be served by.
            ledger: ('<epoch>:<slot>', 'd' or batches had) pairs.
            step: the batches yielded at the checkpoint (ranks must agree).
            shards: S, when no producer published it (from the checkpoint).
            remap: (epoch, slot -> shard): that epoch's slots build these shards (a job
                resumed with another number of ranks).

        Raises:
            StepMismatch: another rank of the job resumed from another step.
        """
        plan = self.plan
        same = plan is not None and plan.fingerprint == fingerprint and plan.hwm != ""
        run = self.resume_run if self.world > 1 and self.resume_run else uuid.uuid4().hex[:16]
        args: list[Any] = [
            self.token,
            run,
            first_shard,
            fingerprint,
            plan.hwm if same and plan else "",
            plan.shards if plan else (shards or 0),
            plan.window if plan else 1,
            plan.epoch_batches if plan else -1,
            self.rank,
            self.world,
            self.even,
            step,
            "1" if self.held else "0",
            "" if remap is None else remap[0],
            0 if remap is None else len(remap[1]),
        ]
        for slot, shard in (remap[1] if remap else {}).items():
            args += [slot, shard]
        for field, value in ledger:
            args += [field, value]
        k = self.keys
        keys = [k.meta, k.incarnation, k.data, k.work, k.failures, k.ledger, k.wake]
        if self.world > 1:  # this rank's list first (dropped on a second resume), remap last
            keys += [self.data_key, *(d for d in self._data_lists() if d != self.data_key)]
        try:
            reply = decode_reply(
                self._retry(lambda: SCRIPTS["resume"](client, keys, args), "resuming")
            )
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            raise wrong_type_error(client, self._types(), e) from e
        if reply[0] == Status.STEP:
            raise StepMismatch(
                f"{self.what}: resumed from a state at step {step}, but the job's other "
                f"ranks resumed from step {reply[1]}; expected the states of one checkpoint"
            )
        if reply[0] != Status.OK:
            raise TrainerConflict(f"{self.what}: the claim was lost while resuming")
        self.run = reply[1]
        log.info("queue %s: resumed at shard %d as run %s", k.queue, first_shard, self.run)
