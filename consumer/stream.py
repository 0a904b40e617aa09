"""ServerDataStream: the trainer's side, Fuel's ``fuel.streams.ServerDataStream`` on Redis.

Constructing one touches nothing that can be lost: Redis is first asked for anything
when the first epoch iterator is requested (or ``len()`` is called), and nothing is
popped before the first iteration.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from batchq.codec import FrameKind
from batchq.connection import call, make_client, resolve_url, tune_malloc
from batchq.errors import (
    BatchQueueError,
    ConfigError,
    ConnectionLost,
    LengthUnknown,
    ProducerFailed,
    ProducersLost,
    TrainerConflict,
)
from batchq.keys import QueueKeys
from batchq.protocol import PROTOCOL_VERSION, Status, decode_reply
from batchq.scripts import SCRIPTS
from consumer.ledger import Ledger
from consumer.reader import BLOCK_S, Reader

__all__ = ["ServerDataStream"]

log = logging.getLogger(__name__)


class ServerDataStream:
    """Batches served by producers through a Redis queue, epoch by epoch.

    Args:
        sources: the names of the sources, in the order batches are yielded.
        produces_examples: as Fuel's; batchq serves batches, so this is usually False.
        host: Redis host (default localhost; see the connection order in the README).
        port: Redis port (default 6379).
        hwm: how many decoded frames the prefetching reader may hold ahead of the
            caller (the queue's own cap is the run's hwm, set by the producers).
        queue: the queue's name.
        url: a redis:// or rediss:// URL; wins over host/port.
        timeout_s: raise ProducersLost when no producer has been alive this long while
            waiting for data.
        ordered: yield each epoch in plan order (the order the stream yields
            in-process); False yields in arrival order.
        writable: yield writable copies instead of read-only views.
        claim_ttl_s: the trainer's claim lapses this long after its last heartbeat.
        max_frame_bytes: frames larger than this are refused (dead list).
        on_bad_frame: 'raise' a FrameError for a frame that fails validation, or 'skip'.
        on_producer_error: 'raise' ProducerFailed when a shard's pipeline kept raising
            (after the producers' retries), or 'skip' the rest of that shard and count
            it (``skipped_shards``).
        stall_s: after this long without a frame while waiting, reap dead producers
            and hand shards with a gap back to the work list.
    """

    def __init__(
        self,
        sources: Sequence[str],
        produces_examples: bool = False,
        host: str | None = None,
        port: int | None = None,
        hwm: int = 10,
        *,
        queue: str = "default",
        url: str | None = None,
        timeout_s: float = 60.0,
        ordered: bool = True,
        writable: bool = False,
        claim_ttl_s: float = 10.0,
        max_frame_bytes: int | None = None,
        on_bad_frame: str = "raise",
        on_producer_error: str = "raise",
        stall_s: float = 5.0,
    ) -> None:
        if isinstance(sources, str) or not all(isinstance(s, str) for s in sources):
            raise ConfigError(f"sources {sources!r} is not valid: expected a tuple of names")
        if not isinstance(hwm, int) or hwm < 1:
            raise ConfigError(f"hwm {hwm!r} is not valid: expected an integer >= 1")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s {timeout_s!r} is not valid: expected > 0")
        if on_bad_frame not in ("raise", "skip"):
            raise ConfigError(f"on_bad_frame {on_bad_frame!r} is not valid: 'raise' or 'skip'")
        self.sources = tuple(sources)
        self.produces_examples = produces_examples
        self.url = resolve_url(url, host, port)
        self.keys = QueueKeys(queue)
        self.hwm = hwm
        self.timeout_s = timeout_s
        self.ordered = ordered
        self.writable = writable
        self.claim_ttl_ms = int(claim_ttl_s * 1000)
        self.max_frame_bytes = max_frame_bytes
        self.on_bad_frame = on_bad_frame
        if on_producer_error not in ("raise", "skip"):
            raise ConfigError(
                f"on_producer_error {on_producer_error!r} is not valid: 'raise' or 'skip'"
            )
        self.on_producer_error = on_producer_error
        self.stall_s = stall_s
        self.epoch = -1  # the epoch of the latest iterator; -1 before the first
        self._client: Any = None
        self._reader: Reader | None = None
        self._ledger: Ledger | None = None
        self._session: dict[str, Any] = {}
        self._closed = False
        # Batches handed out, by the producer that made them (monitoring, tests).
        self.producers_seen: Counter[str] = Counter()
        self.max_buffered = 0  # the most frames the reader held at once

    # -- Fuel's interface --------------------------------------------------------------

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Yield exactly the batches of the next epoch, then stop.

        Args:
            as_dict: yield dicts source -> array instead of tuples in source order.

        Raises:
            ProducerFailed: a producer's pipeline raised in this epoch.
            ProducersLost: no producer alive for timeout_s while waiting.
            FrameError: a frame failed validation (with on_bad_frame='raise').
            TrainerConflict: another trainer holds the queue.
        """
        if self._closed:
            raise BatchQueueError("this ServerDataStream is closed")
        self._start()
        self.epoch += 1
        return self._iterate(self.epoch, as_dict)

    def __len__(self) -> int:
        """Batches per epoch, from the run's plan (waits for a producer to publish it)."""
        self._connect()
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = call(lambda: self._client.hget(self.keys.meta, "epoch_batches"), "reading")
            if value is not None and int(value) >= 0:
                return int(value)
            if value is not None:
                raise LengthUnknown(
                    f"queue {self.keys.queue}: this pipeline cannot tell its batches per "
                    "epoch in advance (it filters or regroups examples)"
                )
            if time.monotonic() > deadline:
                raise ProducersLost(max(self.epoch, 0), [], self.timeout_s)
            # No producer has joined yet: wait for one (bounded, a few checks a second).
            call(lambda: self._client.blpop([self.keys.wake], timeout=BLOCK_S), "waiting")

    def close(self, finished: bool = False) -> None:
        """Stop reading and release the queue.

        Args:
            finished: end the run: the producers finish and exit 0.
        """
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.stop()
        if self._client is None:
            return
        try:
            if self._session.get("run"):
                op = "finish" if finished else "release"
                SCRIPTS["claim"](self._client, self._claim_keys(), self._claim_args(op))
                if finished:
                    self._delete_frames()
        except ConnectionLost as e:
            # The claim lapses by itself; a finished run cannot be announced, though.
            log.warning("queue %s: could not release the claim: %s", self.keys.queue, e)
            if finished:
                raise
        finally:
            self._client.close()

    def __enter__(self) -> ServerDataStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def skipped_shards(self) -> int:
        """Shards skipped under ``on_producer_error='skip'``."""
        return self._ledger.skipped if self._ledger is not None else 0

    def __repr__(self) -> str:
        return f"ServerDataStream(sources={self.sources!r}, queue={self.keys.queue!r})"

    # -- internals ---------------------------------------------------------------------

    def _connect(self) -> None:
        if self._client is None:
            tune_malloc()
            self._client = make_client(self.url)

    def _claim_keys(self) -> list[str]:
        k = self.keys
        return [k.meta, k.incarnation, k.data, k.work, k.wake, k.failures]

    def _claim_args(self, op: str, takeover: str = "") -> list[Any]:
        token = self._session.get("token") or uuid.uuid4().hex
        self._session["token"] = token
        new_run, new_inc = uuid.uuid4().hex[:16], uuid.uuid4().hex
        return [token, self.claim_ttl_ms, op, new_run, new_inc, takeover, PROTOCOL_VERSION]

    def _start(self) -> None:
        if self._reader is not None:
            return
        self._connect()
        reply = decode_reply(
            SCRIPTS["claim"](self._client, self._claim_keys(), self._claim_args("acquire"))
        )
        if reply[0] == Status.CONFLICT:
            self._session = {}
            raise TrainerConflict(
                f"queue {self.keys.queue} is held by another trainer (its claim lapses in "
                f"{int(reply[1]) / 1000:.1f} s unless it is alive); use another queue"
            )
        self._session.update(
            incarnation=reply[1], run=reply[2], claim_ttl_ms=self.claim_ttl_ms, fence=reply[4]
        )
        if int(reply[3]):
            self._delete_frames()
        shards = self._wait_for_shards()
        self._ledger = Ledger(shards, ordered=self.ordered, first_epoch=0)
        self._reader = Reader(
            make_client(self.url),
            self.keys,
            self._session,
            self._ledger,
            hwm=self.hwm,
            timeout_s=self.timeout_s,
            writable=self.writable,
            max_frame_bytes=self.max_frame_bytes,
            on_bad_frame=self.on_bad_frame,
            stall_s=self.stall_s,
        )
        self._reader.start()

    def _wait_for_shards(self) -> int:
        # S comes from the first producer that joins the run.
        deadline = time.monotonic() + self.timeout_s
        while True:
            run, shards, window = call(
                lambda: self._client.hmget(self.keys.meta, ["run", "shards", "window"]),
                "reading meta",
            )
            if run is not None and run.decode() != self._session["run"]:
                raise BatchQueueError(f"queue {self.keys.queue}: the run changed while starting")
            if shards is not None:
                self._session["window"] = int(window or 1)
                return int(shards)
            if time.monotonic() > deadline:
                raise ProducersLost(0, [], self.timeout_s)
            SCRIPTS["claim"](self._client, self._claim_keys(), self._claim_args("refresh"))
            call(lambda: self._client.blpop([self.keys.wake], timeout=BLOCK_S), "waiting")

    def _delete_frames(self) -> None:
        # Frames stored by reference by an older run: nobody will pop their names.
        names = list(self._client.scan_iter(match=self.keys.frame_pattern, count=1000))
        for i in range(0, len(names), 500):
            self._client.delete(*names[i : i + 500])

    def _iterate(self, epoch: int, as_dict: bool) -> Iterator[Any]:
        reader, ledger = self._reader, self._ledger
        if reader is None or ledger is None:  # pragma: no cover - _start sets both
            raise BatchQueueError("the reader did not start")
        with reader.cond:
            ledger.start_epoch(epoch)
            reader.cond.notify_all()
        while True:
            with reader.cond:
                self.max_buffered = max(self.max_buffered, ledger.buffered)
                frame = ledger.next_frame()
                if frame is None:
                    if ledger.epoch_done():
                        reader.cond.notify_all()
                        return
                    waited = self._wait(reader, ledger)
                    reader.add_wait(waited)
                    continue
                reader.cond.notify_all()  # room in the prefetch buffer
            if frame.kind == FrameKind.ERROR and self.on_producer_error == "skip":
                log.warning(
                    "queue %s: skipping epoch %d shard %d, whose pipeline raised %s",
                    self.keys.queue,
                    frame.epoch,
                    frame.shard,
                    frame.error_name,
                )
                with reader.cond:
                    ledger.skip_error(frame)
                continue
            if frame.kind == FrameKind.ERROR:
                raise ProducerFailed(
                    frame.epoch,
                    frame.shard,
                    frame.producer,
                    frame.error or "",
                    f"the producer's pipeline raised {frame.error_name or 'an exception'}",
                )
            self.producers_seen[frame.producer] += 1
            yield frame.as_dict() if as_dict else frame.data

    def _wait(self, reader: Reader, ledger: Ledger) -> float:
        """Wait (holding reader.cond) until a frame arrives or the reader fails."""
        start = time.monotonic()
        reader.waiting_since = start
        try:
            while ledger.next_frame_ready() is False and not ledger.epoch_done():
                if reader.error is not None:
                    raise reader.error
                if not reader.is_alive():
                    raise BatchQueueError("the reader thread stopped")
                reader.cond.wait(timeout=BLOCK_S)
        finally:
            reader.waiting_since = None
        return time.monotonic() - start
