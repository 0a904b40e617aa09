"""Every format batchq writes into Redis, written down once (beside :mod:`batchq.protocol.keys`,
which names the keys).

Entries and fields:

* a lease entry (the lease lists): ``'<g>:<token>'``, g the global slot number
  (:mod:`batchq.protocol.ranks`), token unique per lease request;
* a ledger field (the ledger hash, resume.lua's pairs): ``'<epoch>:<slot>'`` -> ``'d'``
  (done) or the batches the trainer already has;
* a counts field (data-parallel run-time evening): ``'<epoch>:<rank>'`` -> the
  batches the rank has yielded so far, ``'=<n>'`` once its share ended at n
  (:func:`count_value`, :func:`parse_count_value`);
* the server clock: ``TIME`` is (seconds, microseconds); scripts and Python use ms,
  :func:`time_ms`;
* the trainer's wait-time histogram: the stats hash's ``wait_bucket:<i>`` counts waits
  up to :data:`WAIT_BUCKETS_S` ``[i]`` seconds, ``wait_bucket:<len>`` the rest (+Inf).

Caps (lists that would otherwise grow for ever): the wake list keeps
:data:`WAKE_CAP` tokens, a trainer's history :data:`HISTORY_CAP` samples, the dead list
:data:`DEAD_CAP` frames, the scale log :data:`SCALELOG_CAP` decisions. The scripts get
them as arguments (pop.lua, resume.lua).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DEAD_CAP",
    "DONE",
    "HISTORY_CAP",
    "SCALELOG_CAP",
    "WAIT_BUCKETS_S",
    "WAKE_CAP",
    "count_value",
    "counts_field",
    "entry_slot",
    "lease_entry",
    "ledger_field",
    "parse_count_value",
    "parse_ledger_field",
    "time_ms",
]

WAKE_CAP = 8  # a pop wakes at most this many blocked producers
HISTORY_CAP = 3600  # one sample per second: the last hour
DEAD_CAP = 1000  # bad frames kept for `batchq dead`
SCALELOG_CAP = 500  # autoscaler decisions kept
DONE = "d"  # a ledger value: the trainer has every batch of the slot
# Upper bounds of the trainer's wait-time histogram buckets (seconds); the last bucket is
# +Inf. The trainer (consumer.stats) counts into them, the exporter publishes them as le.
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def lease_entry(g: int, token: str) -> str:
    """The lease list's entry for slot ``g`` leased with ``token``."""
    return f"{g}:{token}"


def entry_slot(entry: str) -> int:
    """The global slot number of a lease entry."""
    return int(entry.split(":", 1)[0])


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
