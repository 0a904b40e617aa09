"""A run's plan: what the producers published of it (:class:`Plan`), the one wait for it
(:func:`wait_for_plan`), and what a trainer's resume sends of it (:class:`Shape`, within
the :class:`Restart` it was asked for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from batchq.errors import ProducersLost
from batchq.protocol.fields import MetaField
from batchq.protocol.layout import DONE, parse_ledger_field

__all__ = ["Plan", "Restart", "Shape", "past_remap", "resumed_shape", "wait_for_plan"]


class Plan:
    """What the producers published about the run: enough to re-create it."""

    def __init__(self, meta: dict[bytes, bytes]) -> None:
        def get(name: str, default: str = "") -> str:
            return meta.get(name.encode(), default.encode()).decode()

        f = MetaField
        self.fingerprint = get(f.FINGERPRINT)
        # The run's cap on each data list (meta `hwm`, Fuel's name), an integer: 0 where
        # no producer published the plan (a resume's placeholder).
        hwm = get(f.HWM)
        self.list_cap = int(hwm) if hwm.isdigit() else 0
        self.shards = int(get(f.SHARDS, "0"))
        self.window = int(get(f.WINDOW, "1"))
        self.has_window = f.WINDOW.encode() in meta  # published by the run's first producer
        self.epoch_batches = int(get(f.EPOCH_BATCHES, "-1"))
        self.world = int(get(f.WORLD, "1"))
        self.even = get(f.EVEN, "pad")
        # B, batches per full shard (0: the plan cannot count them; -1: not published).
        stride = get(f.SHARD_BATCHES, "-1")
        self.shard_batches = int(stride) if stride.lstrip("-").isdigit() else -1
        self.stripes = int(get(f.STRIPES, "1"))  # batchq/protocol/stripes.py


def wait_for_plan(
    read: Callable[[], dict[bytes, bytes]],
    idle: Callable[[], None],
    timeout_s: float,
    epoch: int = 0,
) -> Plan:
    """The run's plan, once a producer has published it: ``read()`` the queue's meta
    until it holds the plan, ``idle()`` between reads (a bounded wait on the wake list,
    which a producer's join pushes to).

    The one wait for the plan: the session's (claimed: its ``read`` checks the run and
    its ``idle`` keeps the claim) and ``len()``'s (before any claim).

    Raises:
        ProducersLost: no producer published the plan within ``timeout_s`` (naming
            ``epoch``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        meta = read()
        if MetaField.SHARDS.encode() in meta:
            return Plan(meta)
        if time.monotonic() > deadline:
            raise ProducersLost(max(epoch, 0), [], timeout_s)
        idle()


class Shape(NamedTuple):
    """The plan's figures a resume sends (resume.lua writes them into meta; ``list_cap``
    0: the first producer sets them)."""

    list_cap: int
    shards: int
    window: int
    epoch_batches: int


class Restart(NamedTuple):
    """A :meth:`Session.resume` as asked: the first shard, the pipeline, the ledger's
    pairs, the checkpoint's step, the plan's figures and the remap (if any)."""

    first_shard: int
    fingerprint: str
    ledger: list[tuple[str, str]]
    step: int
    shape: Shape
    remap: tuple[int, dict[int, int]] | None


def resumed_shape(plan: Plan | None, fingerprint: str, shards: int | None) -> Shape:
    """What a resume tells of the plan: the published plan's (its hwm only for the same
    pipeline), or where no producer published one, S from the checkpoint."""
    if plan is None:
        return Shape(0, shards or 0, 1, -1)
    same = plan.fingerprint == fingerprint and plan.list_cap > 0
    return Shape(plan.list_cap if same else 0, plan.shards, plan.window, plan.epoch_batches)


def past_remap(
    ledger: Iterable[tuple[str, str]], remap: tuple[int, dict[int, int]] | None
) -> list[tuple[str, str]]:
    """Of a resume's ledger pairs, the remapped epoch's slots past the remap (done for
    every rank): a run re-created after Redis lost the queue sends them again with the
    remap, so that none is built before the rank it belongs to has recovered."""
    if remap is None:
        return []
    epoch, slots = remap
    fields = [(parse_ledger_field(f), f, v) for f, v in ledger if v == DONE]
    return [(f, v) for (e, slot), f, v in fields if e == epoch and slot not in slots]
