"""``on_sample_error='quarantine'``: an example whose read raises is recorded and replaced.

A map-style dataset (torch, Hugging Face) read with ``on_sample_error='quarantine'``
(:class:`producer.torch.dataset.DatasetStream`) reads a batch example by example where
one raised: the example that raised is recorded (its index, the epoch, the error's type,
message and traceback as text) and replaced by a *substitute*, so every batch keeps its
size, every data-parallel rank its count and every epoch its plan.

The substitute of example i in epoch e is the first of the draws
``substitute_draw(seed, e, i, t)``, t = 0, 1, ..., that is not i and reads without
raising. The draws are a pure function of (the stream's seed, e, i, t), and whether an
example raises is taken as a property of the example, so every producer, every rebuild
and every resume picks the same substitute (an example this producer already met as bad
is skipped without reading it again: the same choice). Before each try the global
generators are seeded from (seed, e, i, t): the substitute's augmentation, and the
examples read after it in the batch, draw the same numbers wherever it is built.

``max_quarantined`` (a fraction of an epoch's examples, default 0.01) bounds the run: once
more distinct examples than that are quarantined (counted over the run, in Redis when
served: a bad example is bad in every epoch), the build raises
:class:`QuarantineExceeded` naming them, which reaches the trainer as ``ProducerFailed``
after ``max_attempts`` (a dataset that broken is not trained on substitutes).

**Records.** In-process the records stay here (:class:`LocalRecords`). A producer
serving the stream binds the run's (:func:`bind_records`, :class:`RunRecords`): every
example replaced by a substitute goes into the run's quarantine hash (quarantine.lua;
``batchq dead`` lists them, ``status`` and ``stream.stats`` count them), and the run's
count bounds ``max_quarantined`` over every producer. The records travel on a client of
their own: an example is met while a batch is built, which may happen while the serving
thread's connection waits for a push's reply.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis

from batchq.client.connection import make_client
from batchq.errors import BatchQueueError, ConfigError
from batchq.protocol import producer_scripts
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import (
    QUARANTINE_CAP,
    parse_quarantine_record,
    quarantine_record,
    read_quarantine,
)
from batchq.protocol.words import Status
from producer.errors import QuarantineExceeded
from producer.randomness import derive_seed
from producer.serving.sharding import find_root

__all__ = [
    "DEFAULT_MAX_QUARANTINED",
    "MAX_DRAWS",
    "ON_SAMPLE_ERROR",
    "LocalRecords",
    "QuarantineRecords",
    "RunRecords",
    "SampleErrors",
    "bind_records",
    "check_sample_errors",
    "set_sample_errors",
    "substitute_draw",
]

log = logging.getLogger(__name__)

ON_SAMPLE_ERROR = ("raise", "quarantine")
DEFAULT_MAX_QUARANTINED = 0.01
MAX_DRAWS = 64  # substitutes tried for one example before the build gives up
_NAMED = 20  # examples a QuarantineExceeded names

ErrorText = tuple[str, str, str]  # an error's type, message and traceback, as text


def check_sample_errors(on_sample_error: Any, max_quarantined: Any) -> None:
    """Refuse an ``on_sample_error`` or ``max_quarantined`` that cannot work.

    Raises:
        ConfigError: naming the value and what was expected.
    """
    if on_sample_error not in ON_SAMPLE_ERROR:
        raise ConfigError(
            f"on_sample_error {on_sample_error!r} is not valid: expected one of {ON_SAMPLE_ERROR}"
        )
    valid = isinstance(max_quarantined, int | float) and not isinstance(max_quarantined, bool)
    if not (valid and 0 <= max_quarantined <= 1):
        raise ConfigError(
            f"max_quarantined {max_quarantined!r} is not valid: expected a fraction of an "
            "epoch's examples, 0 to 1"
        )


def set_sample_errors(
    stream: Any, on_sample_error: str | None, max_quarantined: float | None
) -> None:
    """Set ``on_sample_error`` and ``max_quarantined`` (None: the stream's own) on the
    root of ``stream`` (``start_server``'s arguments).

    Raises:
        ConfigError: a value is invalid, or the root reads no dataset example by example
            (a map-style :class:`producer.torch.dataset.DatasetStream` does, and a Fuel
            :class:`producer.streams.DataStream` whose scheme requests example indices of
            an indexable dataset: :mod:`producer.datasets.sample_errors`).
    """
    root = find_root(stream)
    setter = getattr(root, "set_sample_errors", None)
    if not callable(setter):
        raise ConfigError(
            f"on_sample_error={on_sample_error!r}, max_quarantined={max_quarantined!r} "
            f"given for {type(root).__name__}: expected a stream over a map-style torch or "
            "Hugging Face dataset (producer.torch.DatasetStream), or a Fuel DataStream "
            "whose iteration scheme requests example indices of an indexable dataset"
        )
    setter(on_sample_error, max_quarantined)


def substitute_draw(seed: int, epoch: int, index: int, t: int, examples: int) -> int:
    """The t-th candidate substitute of example ``index`` in ``epoch`` among ``examples``
    (a pure function of its arguments: the same in every producer)."""
    return derive_seed("substitute", seed, epoch, index, t) % examples


class QuarantineRecords(Protocol):
    """Where quarantined examples are recorded: the run's (Redis, when served) or this
    process's (:class:`LocalRecords`)."""

    def record(self, index: int, record: str) -> int:
        """Record example ``index`` (``record``: layout's quarantine_record); returns how
        many distinct examples the run quarantined so far."""

    def listing(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records (parsed)."""


class LocalRecords:
    """Records kept in this process (a stream iterated in-process, or not yet served)."""

    def __init__(self) -> None:
        self.records: dict[int, str] = {}
        self.count = 0

    def record(self, index: int, record: str) -> int:
        if index not in self.records:
            self.count += 1
            if len(self.records) < QUARANTINE_CAP:
                self.records[index] = record
        return self.count

    def listing(self, limit: int) -> list[dict[str, Any]]:
        return [parse_quarantine_record(r) for r in list(self.records.values())[:limit]]


class RunRecords:
    """Quarantined examples recorded in the run a producer serves.

    Args:
        url: the queue's Redis.
        keys: the queue's keys.
        position: ``() -> (incarnation, run)`` of the run served now.
    """

    def __init__(self, url: str, keys: QueueKeys, position: Callable[[], tuple[str, str]]) -> None:
        self.url = url
        self.keys = keys
        self.position = position
        self.local = LocalRecords()  # what could not reach Redis still counts here
        self._client: redis.Redis | None = None
        self._learnt = ("", 0)  # the run and count learn() last read
        self.errors: SampleErrors | None = None  # whom learn() tells

    def record(self, index: int, record: str) -> int:
        local = self.local.record(index, record)
        incarnation, run = self.position()
        try:
            reply = producer_scripts.quarantine(
                self.client, self.keys, incarnation=incarnation, run=run, index=index,
                record=record,
            )  # fmt: skip
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("example %d: quarantine not recorded in Redis: %s", index, e)
            return local
        # Another run now (the shard is dropped anyway): this process's count.
        return reply.first if reply.status == Status.OK else local

    def learn(self, client: redis.Redis) -> None:
        """Tell the stream's :class:`SampleErrors` (bound by :func:`bind_records`) the
        examples the run quarantined since the last call, read on ``client`` (the
        heartbeat's: two fields, the records only when the count changed). So this
        producer meets none of them again: an example that kills its process killed
        another producer once, and is skipped here without a read (the same choice)."""
        _, run = self.position()
        errors = self.errors
        if errors is None:
            return
        head = read_quarantine(client, self.keys, records=False)
        if head.run != run or (head.run, head.count) == self._learnt:
            return
        self._learnt = head.run, head.count
        for record in read_quarantine(client, self.keys).records:
            text = record["error_type"], record["message"], record["traceback"]
            errors.learn(record["index"], text)

    def listing(self, limit: int) -> list[dict[str, Any]]:
        try:
            found = read_quarantine(self.client, self.keys).records
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("quarantined examples not read from Redis: %s", e)
            found = []
        return found[:limit] or self.local.listing(limit)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = make_client(self.url, key=self.keys.meta)
        return self._client

    def close(self) -> None:
        """Close the records' client (made on the first record)."""
        if self._client is not None:
            self._client.close()
            self._client = None


class SampleErrors:
    """What a stream does with an example whose read raises (``on_sample_error``).

    Args:
        mode: 'raise' (the build raises, as before) or 'quarantine'.
        max_quarantined: the most examples quarantined, a fraction of ``epoch_examples``.
        seed: the stream's seed (the substitutes' draws).
        examples: the dataset's size (substitutes are drawn among its indices).
        epoch_examples: the examples an epoch reads.
        pool: the indices substitutes are drawn among where not all (a Fuel scheme's):
            candidate t is then ``pool[substitute_draw(seed, e, i, t, len(pool))]``.
    """

    def __init__(
        self,
        mode: str,
        max_quarantined: float,
        seed: int,
        examples: int,
        epoch_examples: int,
        pool: Sequence[int] | None = None,
    ) -> None:
        check_sample_errors(mode, max_quarantined)
        self.mode = mode
        self.max_quarantined = max_quarantined
        self.seed = seed
        self.examples = examples
        self.pool = None if pool is None or len(pool) == 0 else pool
        self.limit = math.floor(max_quarantined * epoch_examples)
        self.known_bad: set[int] = set()  # at most the dataset's indices
        # What each example met as bad raised (the first time), as text: recorded again
        # when it is met in another run.
        self.errors: dict[int, ErrorText] = {}
        self.records: QuarantineRecords = LocalRecords()
        self.producer = ""
        self.count = 0  # examples the run quarantined, as its records last said

    @property
    def quarantine(self) -> bool:
        """Whether an example that raises is replaced (else the build raises)."""
        return self.mode == "quarantine"

    def learn(self, index: int, error: ErrorText) -> None:
        """Example ``index`` is bad (another producer met it, :meth:`RunRecords.learn`):
        skipped without a read from now on, recorded as ``error`` where met in another
        run (another thread may call this while a batch is built: one set add, one
        dict setdefault)."""
        if 0 <= index < self.examples:  # what a record says is only trusted this far
            self.errors.setdefault(index, error)
            self.known_bad.add(index)

    def candidate(self, epoch: int, index: int, t: int) -> int:
        """The t-th candidate substitute of example ``index`` in ``epoch``."""
        if self.pool is None:
            return substitute_draw(self.seed, epoch, index, t, self.examples)
        return int(self.pool[substitute_draw(self.seed, epoch, index, t, len(self.pool))])

    def bind(self, records: QuarantineRecords, producer: str) -> None:
        """Record in ``records`` from now on (a producer binds the run's)."""
        self.records = records
        self.producer = producer

    def read(
        self, read_one: Callable[[int], Any], index: int, epoch: int, reseed: Callable[[int], None]
    ) -> Any:
        """``read_one(index)``, or where it raises (in quarantine mode) the substitute's.

        Args:
            reseed: seeds the global generators (before each substitute's read).

        Raises:
            QuarantineExceeded: more examples than max_quarantined raised.
            Exception: what ``read_one`` raised, in 'raise' mode.
        """
        if index in self.known_bad and self.quarantine:
            # Met as bad before: not read again (the same choice), recorded again (the
            # run may be another since: a resume's; quarantine.lua records it once).
            return self._substitute(read_one, index, epoch, reseed, self.errors.get(index))
        try:
            return read_one(index)
        except Exception as e:
            if not self.quarantine:
                raise
            return self._substitute(read_one, index, epoch, reseed, _texts(e))

    def _substitute(
        self,
        read_one: Callable[[int], Any],
        index: int,
        epoch: int,
        reseed: Callable[[int], None],
        error: ErrorText | None,
    ) -> Any:
        self.known_bad.add(index)
        for t in range(MAX_DRAWS):
            j = self.candidate(epoch, index, t)
            if j in self.known_bad:
                continue  # met as bad before: trying it again would raise again
            # Seeded per try: the same draws whichever candidates this process skipped.
            reseed(derive_seed("substitute-read", self.seed, epoch, index, t))
            try:
                value = read_one(j)
            except Exception as e:
                self.known_bad.add(j)
                self._met(j, epoch, -1, _texts(e))
                continue
            if error is not None:
                self._met(index, epoch, j, error)
            else:
                self._check_count()  # a rebuild meets it again: still over the cap
            return value
        raise QuarantineExceeded(
            f"example {index} of epoch {epoch} raised and no substitute among "
            f"{MAX_DRAWS} drawn read without raising"
        )

    def _met(self, index: int, epoch: int, substitute: int, error: ErrorText) -> None:
        """Record example ``index`` (``substitute`` -1: met as a candidate substitute)
        and enforce max_quarantined."""
        first = index not in self.errors
        self.errors.setdefault(index, error)
        record = quarantine_record(index, epoch, substitute, *error, self.producer)
        self.count = self.records.record(index, record)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "example %d of epoch %d raised %s: replaced by example %d",
            index, epoch, error[0], substitute,
        )  # fmt: skip
        self._check_count()

    def _check_count(self) -> None:
        """Raise QuarantineExceeded, naming the examples, past max_quarantined."""
        if self.count <= self.limit:
            return
        named = ", ".join(
            f"{r['index']} ({r['error_type']}: {r['message'][:80]})"
            for r in self.records.listing(_NAMED)
        )
        raise QuarantineExceeded(
            f"{self.count} examples quarantined, more than max_quarantined="
            f"{self.max_quarantined} of an epoch's examples allows ({self.limit}): {named}"
        )


def _texts(error: BaseException) -> ErrorText:
    """What a record says of ``error``: its type, message and traceback."""
    text = "".join(traceback.format_exception(error))
    return type(error).__qualname__, _message(error), text


def _message(error: BaseException) -> str:
    """The error's message; a ``str()`` that itself raises still gives text."""
    try:
        return str(error)
    except Exception as e:  # a broken __str__ must not hide the example
        return f"<{type(error).__qualname__}: str() raised {type(e).__qualname__}>"


def bind_records(
    stream: Any, url: str, keys: QueueKeys, producer: str, position: Callable[[], tuple[str, str]]
) -> RunRecords | None:
    """Bind the run's records to the stream's root where it quarantines examples
    (``sample_errors`` in 'quarantine' mode); None where it does not, or where a producer
    bound them already (a striped producer's lanes share the stream: stripe 0's, the
    first, records, where ``batchq dead --queue Q`` reads)."""
    errors = getattr(find_root(stream), "sample_errors", None)
    if not isinstance(errors, SampleErrors) or not errors.quarantine:
        return None
    if isinstance(errors.records, RunRecords):
        return None
    records = RunRecords(url, keys, position)
    errors.bind(records, producer)
    records.errors = errors
    return records
