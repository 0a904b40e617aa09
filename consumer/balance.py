"""Equal batch counts on every rank when the plan cannot tell them in advance.

Where every shard is one batch, a rank's share of an epoch is a fixed number of slots
(:mod:`batchq.protocol.ranks`) and counts are equal by construction. Where shards hold several
batches (or a Filter drops some) they are only known as the epoch is read, so the ranks
of a job tell each other their counts through one hash (``bq:{Q}:counts``, field
``'<epoch>:<rank>'``: ``'<n>'`` batches in hand so far, ``'=<n>'`` the rank's final count
for that epoch) and:

- ``'pad'``: a rank that reaches the end of its share publishes its final count, waits
  (bounded) for every rank's, then yields again its own first batches of the epoch
  (kept, up to ``keep``; cycled if more are needed) until it reaches the largest count;
- ``'drop'``: a rank yields its i-th batch only once every other rank has said it has
  at least i + 1, and ends the epoch as soon as one rank's final count is i; it
  publishes its own count with every batch, so a rank waiting is never waiting for one
  that is itself waiting (a waiting rank holds its next batch, and said so).

Every wait is bounded by ``timeout_s`` (:class:`batchq.errors.RankLost` names the
silent ranks).

Where the plan counts every shard's batches (B each, the last 1 to B: no Filter) and
without ``on_producer_error='skip'``, each rank's count is known before the epoch
(:meth:`RankLayout.slot_batches`; in an epoch re-split for another world, from its
remap: each slot's shard less the batches had), and nothing is waited for: 'pad' pads
up to the largest, 'drop' ends the epoch with its batch of the smallest count, cut
before that batch is yielded (so a checkpoint taken there is already past the epoch, as
every other rank's is). Ranks that step together (DDP's all-reduce) need that:
a rank waiting for another's final count would wait for a rank that waits for it.

Where every shard is one batch, nothing is exchanged: :class:`StaticPads` only counts
the pad slots a rank yields. :func:`even_counts` picks which of the two a rank needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from batchq.client.connection import call
from batchq.errors import RankLost
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import (
    count_value,
    counts_field,
    parse_count_value,
    parse_shard_count,
    shard_count_field,
)
from batchq.protocol.ranks import RankLayout
from batchq.wire.codec import Frame

__all__ = ["POLL_S", "Balancer", "StaticPads", "even_counts"]

# How often a waiting rank reads the others' counts.
POLL_S = 0.05


class Balancer:
    """One rank's side of the count exchange.

    Args:
        client: the stream's client.
        keys: the queue's keys.
        rank: this rank.
        world: the number of ranks.
        even: 'pad' or 'drop'.
        timeout_s: the longest wait for the other ranks.
        keep: how many of its first batches a rank keeps to pad with.
        counted: every rank's batches of an epoch where the plan fixes them (None where
            they are only known as the epoch is read).
        shards: the rank's local shards per epoch (P).
        ordered: whether the rank yields its shards in plan order: then, where the plan
            cannot count them, it publishes each local shard's batches as it passes it
            (:meth:`publish_shards`), from which one rank's state rebuilds every rank's
            position (consumer/rank_state.py).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        rank: int,
        world: int,
        even: str,
        timeout_s: float,
        keep: int,
        counted: Callable[[int], list[int] | None] = lambda epoch: None,
        shards: int = 0,
        ordered: bool = False,
    ) -> None:
        self.client = client
        self.counted = counted
        self.shards = shards
        self.ordered = ordered
        self.keys = keys
        self.rank = rank
        self.world = world
        self.even = even
        self.timeout_s = timeout_s
        self.keep = max(1, keep)
        self.padded = 0  # batches yielded twice to even the counts (all epochs)
        # The shards of the epoch's run-time pads yielded so far, in order: a wrapper
        # holding some back holds no batch of the ledger (EpochFeed.ledger_held).
        self.pad_shards: list[int] = []
        self.cuts = 0  # epochs whose share 'drop' ended early to even the counts

    def _publish(self, epoch: int, n: int, final: bool) -> None:
        field, value = counts_field(epoch, self.rank), count_value(n, final)
        call(
            lambda: self.client.hset(self.keys.counts, field, value),
            "publishing the rank's count",
            self.client,
        )

    def _others(self, epoch: int) -> dict[int, tuple[int, bool]]:
        """The other ranks' (count, final) for ``epoch``, for those that said one."""
        ranks = [r for r in range(self.world) if r != self.rank]
        values: list[Any] = call(
            lambda: self.client.hmget(self.keys.counts, [counts_field(epoch, r) for r in ranks]),
            "reading the ranks' counts",
            self.client,
        )
        out = {}
        for r, value in zip(ranks, values, strict=True):
            if value is not None:
                out[r] = parse_count_value(value)
        return out

    def _wait(self, epoch: int, done: Callable[[dict[int, tuple[int, bool]]], bool]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            others = self._others(epoch)
            if done(others):
                return others
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world) if r != self.rank and r not in others]
                raise RankLost(epoch, silent or sorted(others), self.timeout_s)
            time.sleep(POLL_S)

    def start_epoch(self, epoch: int) -> None:
        """Forget this rank's counts of epochs before the previous one (a state of the
        previous one may still need its shard counts: the others may be inside it)."""
        self.pad_shards = []
        if epoch >= 2:
            old = [counts_field(epoch - 2, self.rank)]
            if self.publishes(epoch - 2):
                old += [shard_count_field(epoch - 2, self.rank, j) for j in range(self.shards)]
            call(
                lambda: self.client.hdel(self.keys.counts, *old),
                "dropping old counts",
                self.client,
            )

    def publishes(self, epoch: int) -> bool:
        """Whether this rank publishes its shard counts of ``epoch``: it yields in plan
        order and the plan cannot count them (a Filter, shards skipped on an error)."""
        return self.ordered and self.shards > 0 and self.counted(epoch) is None

    def publish_shards(self, epoch: int, counts: dict[int, int]) -> None:
        """Say the batches of this rank's local shards of ``epoch`` (shard -> batches),
        each as soon as its ledger knows it. Every shard before a batch is said before
        the rank yields that batch, so by the time any rank saves a step (DDP's ranks
        step together) every rank said the counts of the shards its batches up to that
        step passed."""
        fields: dict[FieldT, EncodableT] = {
            shard_count_field(epoch, self.rank, j): n for j, n in counts.items()
        }
        call(
            lambda: self.client.hset(self.keys.counts, mapping=fields),
            "publishing the rank's shard counts",
            self.client,
        )

    def shard_counts(self, epoch: int) -> list[list[int | None]] | None:
        """Every rank's published shard counts of ``epoch``: per rank the batches of its
        local shards 0, 1, ... (None: not said; the list ends at the last one said), or
        None where they are not published (the plan counts them, or the rank yields in
        arrival order). One read, no wait."""
        if not self.publishes(epoch):
            return None
        names = [
            shard_count_field(epoch, r, j) for r in range(self.world) for j in range(self.shards)
        ]
        values: list[Any] = call(
            lambda: self.client.hmget(self.keys.counts, names),
            "reading the ranks' shard counts",
            self.client,
        )
        out = []
        for r in range(self.world):
            said = [
                parse_shard_count(v) if v is not None else None
                for v in values[r * self.shards : (r + 1) * self.shards]
            ]
            while said and said[-1] is None:
                said.pop()
            out.append(said)
        return out

    def balance(
        self, epoch: int, frames: Iterator[Frame], cut: Callable[[], None], already: int = 0
    ) -> Iterator[Frame]:
        """This rank's frames of ``epoch``, evened with the other ranks.

        Args:
            frames: the rank's own frames of the epoch.
            cut: called when 'drop' ends the epoch before ``frames`` does.
            already: batches of the epoch yielded before the checkpoint resumed from
                (every rank of one checkpoint resumed at the same count: the counts
                exchanged are those since; the plan's are the whole epoch's).
        """
        if self.even == "drop":
            yield from self._drop(epoch, frames, cut, already)
        else:
            yield from self._pad(epoch, frames, already)

    def _pad(self, epoch: int, frames: Iterator[Frame], already: int) -> Iterator[Frame]:
        kept: list[Frame] = []
        n = 0
        for frame in frames:
            if len(kept) < self.keep:
                kept.append(frame)
            n += 1
            yield frame
        self._publish(epoch, n, final=True)
        target = max([n, *self._final_counts(epoch, already)])
        if target > n and not kept:
            raise RankLost(epoch, [], self.timeout_s, empty=self.rank)
        for i in range(target - n):
            self.padded += 1
            self.pad_shards.append(kept[i % len(kept)].shard)
            yield kept[i % len(kept)]

    def _final_counts(self, epoch: int, already: int) -> list[int]:
        """Every rank's count of ``epoch`` since the checkpoint resumed from: the plan's
        where it fixes them, else as each rank publishes its final one (waited for)."""
        totals = self.counted(epoch)
        if totals is not None:
            return [total - already for total in totals]
        others = self._wait(
            epoch, lambda o: len(o) == self.world - 1 and all(f for _, f in o.values())
        )
        return [c for c, _ in others.values()]

    def _drop(
        self, epoch: int, frames: Iterator[Frame], cut: Callable[[], None], already: int
    ) -> Iterator[Frame]:
        totals = self.counted(epoch)
        if totals is not None:
            count, own = min(totals) - already, totals[self.rank] - already
            yield from self._drop_counted(epoch, frames, cut, count, own)
            return
        n = 0
        known: dict[int, tuple[int, bool]] = {}
        for frame in frames:
            self._publish(epoch, n + 1, final=False)  # it holds batch n: say so first

            def enough(o: dict[int, tuple[int, bool]], need: int = n + 1) -> bool:
                if len(o) < self.world - 1:
                    return False
                return all(c >= need or final for c, final in o.values())

            if not enough(known):
                known = self._wait(epoch, enough)
            if any(final and c < n + 1 for c, final in known.values()):
                # Another rank's share ended: this one's ends here too.
                self._publish(epoch, n, final=True)
                self.cuts += 1
                cut()
                return
            n += 1
            yield frame
        self._publish(epoch, n, final=True)

    def _drop_counted(
        self, epoch: int, frames: Iterator[Frame], cut: Callable[[], None], count: int, own: int
    ) -> Iterator[Frame]:
        """'drop' where every rank's count is known: the epoch ends with batch ``count``,
        the cut made before it is yielded. Each batch is published in hand as on the
        waiting path, so a rank that could not count (another plan seen, an option of
        its own) and waits on the exchange is answered."""
        n = 0
        if count <= 0:  # resumed at or past the count (a state saved by earlier code)
            self._publish(epoch, 0, final=True)
            cut()
            return
        for frame in frames:
            n += 1
            if n >= count:
                self._publish(epoch, n, final=True)
                if own > count:
                    self.cuts += 1
                    cut()
                yield frame
                return
            self._publish(epoch, n, final=False)  # it holds batch n: as the waiting path says
            yield frame
        self._publish(epoch, n, final=True)


class StaticPads:
    """Where every shard is one batch, a rank's counts are equal by its slots alone:
    this counts the pad slots it yields (one of the epoch's first batches again).

    Args:
        layout: the job's split (with pads).
        rank: this rank.
    """

    def __init__(self, layout: RankLayout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.padded = 0  # pad slots yielded (all epochs)

    def start_epoch(self, epoch: int) -> None:
        """Nothing to forget: no counts are exchanged."""

    def balance(
        self, epoch: int, frames: Iterator[Frame], cut: Callable[[], None], already: int = 0
    ) -> Iterator[Frame]:
        """The rank's frames of ``epoch`` as they are, its pads counted."""
        layout, rank = self.layout, self.rank
        for frame in frames:
            if layout.slot(frame.shard, rank) >= layout.shards:
                self.padded += 1
            yield frame


def even_counts(
    layout: RankLayout,
    one_batch_shards: bool,
    client: redis.Redis,
    keys: QueueKeys,
    rank: int,
    timeout_s: float,
    keep: int,
    *,
    figures: tuple[int, int] | None = None,
    remap: tuple[int, list[list[int]]] | None = None,
    ordered: bool = False,
) -> Balancer | StaticPads | None:
    """How this rank's counts come out equal: by the slots alone where every shard is one
    batch (pads counted as they are yielded; None where there are none), else by telling
    the other ranks (a :class:`Balancer`, given the rest), which need not wait where the
    plan counts them. None for a single trainer.

    Args:
        figures: the plan's (B, E) where they count every shard's batches (None: not
            known, or not to be trusted: shards skipped on a producer's error).
        remap: the epoch re-split for another world this rank resumed in, and its remap
            (slot -> [shard, batches had]): that epoch's counts are each slot's shard's
            less what was had of it.
        ordered: the rank yields in plan order (it then publishes its shard counts where
            the plan cannot count them: :meth:`Balancer.publish_shards`).
    """
    if layout.world == 1:
        return None
    if one_batch_shards:
        return StaticPads(layout, rank) if layout.pads else None
    shares = layout.slot_batches(*figures) if figures is not None else None
    totals = [sum(share) for share in shares] if shares is not None else None
    remapped = _remap_totals(layout, figures, remap[1]) if remap is not None else None

    def counted(epoch: int) -> list[int] | None:
        return remapped if remap is not None and epoch == remap[0] else totals

    return Balancer(
        client, keys, rank, layout.world, layout.even, timeout_s, keep=keep, counted=counted,
        shards=layout.per_rank, ordered=ordered,
    )  # fmt: skip


def _remap_totals(
    layout: RankLayout, figures: tuple[int, int] | None, units: list[list[int]]
) -> list[int] | None:
    """Each rank's batches of an epoch re-split by ``units`` (slot u: [shard, batches
    had], rank u % world; the slots past them are done), where the plan counts every
    shard's."""
    count = layout.shard_counts(*figures) if figures is not None else None
    if count is None:
        return None
    totals = [0] * layout.world
    for u, (shard, had) in enumerate(units):
        totals[u % layout.world] += count[shard] - had
    return totals
