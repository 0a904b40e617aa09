"""Every format batchq writes into Redis, written down once (beside :mod:`batchq.protocol.keys`,
which names the keys).

Entries and fields:

* a lease entry (the lease lists): ``'<g>:<run>:<token>'``, g the global slot number
  (:mod:`batchq.protocol.ranks`), run the id of the run it was granted in, token unique
  per lease request; in a run read by several groups ``'<g>/<mask>:<run>:<token>'``
  where the shard is for other groups than slot 0 alone (mask: bit i set for group slot
  i, :mod:`batchq.protocol.groups`). The run is there so that a lease list that outlived
  its run (a killed producer's) is never handed to the next one: reap.lua and join.lua
  give back only the entries of the queue's current, unfinished run and drop
  the others (:func:`entry_run`);
* a work entry (the work list): ``'<g>'`` or ``'<g>/<mask>'`` (the part of a lease entry
  before its token: a shard handed back is built again for the same groups);
* a frame stored by reference for several groups: the refs hash's field is the frame's
  key, its value how many groups have still to read it (no field: one);
* a ledger field (the ledger hash, resume.lua's pairs): ``'<epoch>:<slot>'`` -> ``'d'``
  (done) or the batches the trainer already has;
* a counts field (data-parallel run-time evening): ``'<epoch>:<rank>'`` -> the
  batches the rank has yielded so far, ``'=<n>'`` once its share ended at n
  (:func:`count_value`, :func:`parse_count_value`); and ``'n:<epoch>:<rank>:<j>'`` ->
  the batches of the rank's local shard j that epoch, once known (:func:`shard_count_field`:
  one rank's state rebuilds every rank's position from them where the plan cannot count
  its shards, consumer/balance.py);
* the server clock: ``TIME`` is (seconds, microseconds); scripts and Python use ms,
  :func:`time_ms`;
* the trainer's wait-time histogram: the stats hash's ``wait_bucket:<i>`` counts waits
  up to :data:`WAIT_BUCKETS_S` ``[i]`` seconds, ``wait_bucket:<len>`` the rest (+Inf);
* the run's change log of producer parameters (the ``params`` key, a string):
  ``{"run": run id, "entries": [{"version": v, "index": i, "id": call id, "params":
  {...}}, ...]}`` (:mod:`batchq.protocol.params_log`), at most
  :data:`PARAMS_LOG_MAX_BYTES` of JSON and :data:`PARAMS_MAX_ENTRIES` entries; meta's
  ``params`` field is its stamp ``'<run>:<version>'`` (:func:`params_stamp`), which
  lease.lua returns with every lease so that a producer reads the log again only when
  it changed;
* a quarantined example (the quarantine hash's field ``'i:<index>'``,
  ``on_sample_error='quarantine'``): a JSON object ``{"index", "epoch", "substitute",
  "error_type", "message", "traceback", "producer"}`` (:func:`quarantine_record`,
  :func:`parse_quarantine_record`), the message and traceback cut to
  :data:`QUARANTINE_TEXT_MAX` characters, at most :data:`QUARANTINE_CAP` records a run;
  the hash's ``run`` and ``count`` fields say which run quarantined how many. The whole
  hash is read back by :func:`read_quarantine` (a :class:`Quarantine`): ``batchq dead``
  lists the records, ``status`` rows and ``stream.stats`` count them, a producer names
  them when ``max_quarantined`` is passed;
* a default process id (a producer's, an autoscaler's): ``'<host>-<pid>-<6 hex>'``
  (:func:`default_id`; :func:`id_host` and :func:`id_pid` read it back: ``status``
  shows the host, an autoscaler tells its own workers by the pid).

Caps (lists that would otherwise grow for ever): a run has at most :data:`MAX_GROUPS`
group slots; the wake list keeps :data:`WAKE_CAP` tokens, a trainer's history
:data:`HISTORY_CAP` samples, the dead list :data:`DEAD_CAP` frames, the scale log
:data:`SCALELOG_CAP` decisions. The scripts get them as arguments (pop.lua, resume.lua,
claim.lua).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import as_int, as_text

__all__ = [
    "DEAD_CAP",
    "DONE",
    "FLAGS",
    "HISTORY_CAP",
    "MAX_GROUPS",
    "PARAMS_LOG_MAX_BYTES",
    "PARAMS_MAX_ENTRIES",
    "QUARANTINE_CAP",
    "QUARANTINE_FIELDS",
    "QUARANTINE_TEXT_MAX",
    "RUN_ID_CHARS",
    "SCALELOG_CAP",
    "WAIT_BUCKETS_S",
    "WAKE_CAP",
    "Quarantine",
    "count_value",
    "counts_field",
    "default_id",
    "entry_run",
    "entry_slot",
    "flag",
    "id_host",
    "id_pid",
    "lease_entry",
    "ledger_field",
    "lost_run_id",
    "new_run_id",
    "params_stamp",
    "parse_count_value",
    "parse_ledger_field",
    "parse_params_stamp",
    "parse_quarantine_record",
    "parse_shard_count",
    "parse_work_entry",
    "quarantine_record",
    "read_quarantine",
    "resume_run_id",
    "shard_count_field",
    "stripe_run_id",
    "time_ms",
    "trainer_client_name",
    "work_entry",
]

WAKE_CAP = 8  # a pop wakes at most this many blocked producers
HISTORY_CAP = 3600  # one sample per second: the last hour
DEAD_CAP = 1000  # bad frames kept for `batchq dead`
QUARANTINE_CAP = 1000  # quarantined examples' records kept per run (`batchq dead`)
QUARANTINE_TEXT_MAX = 4000  # characters of a quarantined example's message, traceback
SCALELOG_CAP = 500  # autoscaler decisions kept
# Group slots of one run (a sweep's trials): one release word each in a shared-memory
# segment's header (batchq.wire.shm), one bit each in a lease's mask.
MAX_GROUPS = 32
# The change log of producer parameters (set_params): its JSON and its entries. Every
# producer reads the whole log when it changes, so it stays small.
PARAMS_LOG_MAX_BYTES = 1 << 20
PARAMS_MAX_ENTRIES = 10_000
DONE = "d"  # a ledger value: the trainer has every batch of the slot
# Upper bounds of the trainer's wait-time histogram buckets (seconds); the last bucket is
# +Inf. The trainer (consumer.stats) counts into them, the exporter publishes them as le.
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


#: A boolean as the scripts read it (an argument, a meta field): ``FLAGS[value]``, i.e.
#: ``'1'`` or ``'0'`` (indexed, not called: the scripts' wrappers build it on every call).
FLAGS = ("0", "1")


def flag(value: bool) -> str:
    """A boolean as the scripts read it: ``'1'`` or ``'0'`` (:data:`FLAGS`)."""
    return FLAGS[bool(value)]


def work_entry(g: int, mask: int = 1) -> str:
    """The work list's entry for slot ``g`` built for the groups of ``mask`` (``1``, group
    slot 0 alone, is the plain ``'<g>'`` of a run of one group)."""
    return str(g) if mask == 1 else f"{g}/{mask}"


def parse_work_entry(entry: str) -> tuple[int, int]:
    """(g, mask) of a work entry (or of a lease entry's part before its token).

    Raises:
        ValueError: not ``'<g>'`` nor ``'<g>/<mask>'``.
    """
    g, _, mask = entry.partition("/")
    return int(g), int(mask) if mask else 1


def lease_entry(g: int, run: str, token: str, mask: int = 1) -> str:
    """The lease list's entry for slot ``g`` leased in run ``run`` with ``token`` for the
    groups of ``mask``."""
    return f"{work_entry(g, mask)}:{run}:{token}"


def entry_slot(entry: str) -> int:
    """The global slot number of a lease entry."""
    return parse_work_entry(entry.split(":", 1)[0])[0]


def entry_run(entry: str) -> str:
    """The run a lease entry was granted in.

    Raises:
        ValueError: not ``'<g>[/<mask>]:<run>:<token>'``.
    """
    parts = entry.split(":", 2)
    if len(parts) < 3:
        raise ValueError(f"lease entry {entry!r}: expected '<g>[/<mask>]:<run>:<token>'")
    return parts[1]


def params_stamp(run: str, version: int) -> str:
    """Meta's ``params`` field: the run whose log it is and the log's version."""
    return f"{run}:{version}"


def parse_params_stamp(stamp: str) -> tuple[str, int]:
    """(run, version) of a params stamp; ('', 0) for none or one of another form."""
    run, sep, version = stamp.rpartition(":")
    return (run, int(version)) if sep and version.isdigit() else ("", 0)


def ledger_field(epoch: int, slot: int) -> str:
    """The ledger hash's field of a slot of an epoch."""
    return f"{epoch}:{slot}"


def parse_ledger_field(field: str) -> tuple[int, int]:
    """(epoch, slot) of a ledger field.

    Raises:
        ValueError: not '<epoch>:<slot>'.
    """
    epoch, slot = field.split(":")
    return int(epoch), int(slot)


def counts_field(epoch: int, rank: int) -> str:
    """The counts hash's field of a rank's final count in an epoch."""
    return f"{epoch}:{rank}"


def shard_count_field(epoch: int, rank: int, shard: int) -> str:
    """The counts hash's field of the batches of a rank's local shard in an epoch."""
    return f"n:{epoch}:{rank}:{shard}"


def parse_shard_count(value: bytes) -> int | None:
    """The batches a shard count field says; None where it is not a count >= 0 (a foreign
    value, not trusted)."""
    text = value.decode(errors="replace")
    return int(text) if text.isascii() and text.isdigit() and len(text) < 12 else None


def count_value(n: int, final: bool) -> str:
    """A counts field's value: the rank's batches so far, or its final count."""
    return f"={n}" if final else str(n)


def parse_count_value(value: bytes) -> tuple[int, bool]:
    """(batches, final) of a counts field's value.

    Raises:
        ValueError: neither ``'<n>'`` nor ``'=<n>'``.
    """
    text = value.decode()
    return int(text.removeprefix("=")), text.startswith("=")


def time_ms(reply: Sequence[int | str | bytes]) -> int:
    """Milliseconds of a ``TIME`` reply (seconds, microseconds)."""
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


# A run's id, minted only here: 16 hex digits, fresh or derived. A fresh run (a producer
# or a trainer starting one) gets a random id; the processes that must meet in one run
# without talking to each other derive it alike from what they share: the ranks (and
# groups) of a job resuming one checkpoint, a striped queue's stripes, a run re-created
# after Redis lost it.
RUN_ID_CHARS = 16


def _derived(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:RUN_ID_CHARS]


def new_run_id() -> str:
    """A fresh run's id (random)."""
    return uuid.uuid4().hex[:RUN_ID_CHARS]


def resume_run_id(run: str, world: int) -> str:
    """The run every rank (and group) resuming checkpoint run ``run`` with ``world`` ranks
    resumes into: the first creates it, the others join it. Not the step: a rank resuming
    from another step must find the run and be refused."""
    return _derived(f"resume:{run}:{world}")


def stripe_run_id(run: str, stripe: int) -> str:
    """Stripe ``stripe``'s new run when stripe 0 starts ``run`` (the ranks of a job name
    it alike)."""
    return _derived(f"{run}:stripe:{stripe}")


def lost_run_id(incarnation: str) -> str:
    """The run re-created after Redis lost the queue of ``incarnation`` (the ranks that
    notice it name it alike)."""
    return _derived(f"lost:{incarnation}")


def default_id() -> str:
    """A new id for this process: ``'<host>-<pid>-<6 hex>'``, the host name up to 40
    characters with any character outside ``[A-Za-z0-9_.-]`` as ``'-'`` (a valid
    :func:`batchq.protocol.keys.check_name`)."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host[:40] or 'host'}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def trainer_client_name() -> str:
    """A new name for one trainer's connections (CLIENT SETNAME): ``'bq-trainer-'`` and
    a :func:`default_id`. claim.lua records it with the claim; no open connection of
    that name means the holder's process died (:mod:`consumer.session`)."""
    return f"bq-trainer-{default_id()}"


def id_host(process_id: str) -> str:
    """The host part of a :func:`default_id`, else the whole id."""
    parts = process_id.rsplit("-", 2)
    return parts[0] if len(parts) == 3 else process_id


def id_pid(process_id: str) -> int | None:
    """The pid in a :func:`default_id`, None for an id of another form."""
    parts = process_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


#: The fields of a quarantined example's record, in order.
QUARANTINE_FIELDS = (
    "index",
    "epoch",
    "substitute",
    "error_type",
    "message",
    "traceback",
    "producer",
)


def quarantine_record(
    index: int,
    epoch: int,
    substitute: int,
    error_type: str,
    message: str,
    traceback: str,
    producer: str,
) -> str:
    """The quarantine hash's record of example ``index`` (JSON; the message and the
    traceback cut to :data:`QUARANTINE_TEXT_MAX` characters, the end of a traceback
    kept: its last lines say where it raised)."""
    return json.dumps(
        {
            "index": index,
            "epoch": epoch,
            "substitute": substitute,
            "error_type": error_type[:200],
            "message": message[:QUARANTINE_TEXT_MAX],
            "traceback": traceback[-QUARANTINE_TEXT_MAX:],
            "producer": producer,
        }
    )


def parse_quarantine_record(raw: str | bytes) -> dict[str, Any]:
    """A quarantined example's record as written by :func:`quarantine_record`.

    Raises:
        ValueError: not such a record (another writer's, or truncated).
    """
    if len(raw) > 4 * QUARANTINE_TEXT_MAX + 1000:
        raise ValueError(f"quarantine record of {len(raw)} bytes: expected a record")
    value = json.loads(raw)
    if not isinstance(value, dict) or set(value) != set(QUARANTINE_FIELDS):
        raise ValueError(f"quarantine record {value!r:.200}: expected {QUARANTINE_FIELDS}")
    kinds = [int] * 3 + [str] * 4
    if not all(type(value[f]) is k for f, k in zip(QUARANTINE_FIELDS, kinds, strict=True)):
        raise ValueError(f"quarantine record {value!r:.200}: expected 3 integers, 4 strings")
    return value


@dataclass
class Quarantine:
    """The quarantine hash of a queue: the run it is for, how many examples that run
    quarantined (exact while the records fit), and the records (by index)."""

    run: str = ""
    count: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def count_of(self, run: str) -> int:
        """The count for ``run`` (0 where the hash is another run's)."""
        return self.count if run and run == self.run else 0


def read_quarantine(client: redis.Redis, keys: QueueKeys, *, records: bool = True) -> Quarantine:
    """The queue's quarantine hash (one HGETALL, bounded by QUARANTINE_CAP records; with
    ``records=False`` two fields only). Records that do not parse are left out."""
    if not records:
        run, count = client.hmget(keys.quarantine, ["run", "count"])
        return Quarantine(as_text(run) if run else "", as_int(count))
    raw_fields: dict[Any, Any] = client.hgetall(keys.quarantine)
    fields = {as_text(k): v for k, v in raw_fields.items()}
    out = Quarantine(as_text(fields.get("run", "")), as_int(fields.get("count")))
    for name, raw in fields.items():
        if name.startswith("i:"):
            try:
                out.records.append(parse_quarantine_record(raw))
            except ValueError:
                continue  # not a record this version writes
    out.records.sort(key=lambda r: (r["epoch"], r["index"]))
    return out
