"""A stream's epochs, frame by frame: from the buffer to the caller.

:func:`batch_frames` takes an epoch's frames from the buffer (waiting for each): an
ERROR frame raises :class:`~batchq.errors.ProducerFailed`, or under
``on_producer_error='skip'`` skips the rest of its shard. A rank's counts are evened on
the way (:mod:`consumer.balance`). :class:`EpochFeed` hands the frames out: each one
timed into the trainer's figures, counted by the producer that made it, the reader
thread's cast warnings raised on the training thread, the progress bar drawn (an
optional :class:`EpochProgress` per epoch: batches, rate and stall %, on stderr, with
rich).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from batchq.errors import ConfigError, ProducerFailed
from batchq.wire.codec import Frame, FrameKind
from consumer.balance import Balancer, StaticPads
from consumer.plan import BLOCK_S
from consumer.reader.buffer import Buffer
from consumer.reader.prepare import FramePrep
from consumer.reader.stats import TrainerStats

__all__ = ["EpochFeed", "EpochProgress", "batch_frames"]

log = logging.getLogger(__name__)


def batch_frames(
    buffer: Buffer, alive: Callable[[], bool], *, skip_errors: bool, queue: str
) -> Iterator[Frame]:
    """The epoch's batch frames from the buffer, waiting for each.

    Args:
        alive: whether the reader thread still runs.
        skip_errors: skip the rest of a shard whose pipeline raised (else raise).
        queue: the queue's name (for messages).

    Raises:
        ProducerFailed: a shard's pipeline raised (``skip_errors`` False).
    """
    while (frame := buffer.take(alive, BLOCK_S)) is not None:
        if frame.kind != FrameKind.ERROR:
            yield frame
            continue
        if not skip_errors:
            raise ProducerFailed(
                frame.epoch,
                frame.shard,
                frame.producer,
                frame.error or "",
                f"the producer's pipeline raised {frame.error_name or 'an exception'}",
            )
        log.warning(
            "queue %s: skipping epoch %d shard %d, whose pipeline raised %s",
            queue,
            frame.epoch,
            frame.shard,
            frame.error_name,
        )
        buffer.skip_error(frame)


class EpochFeed:
    """Hands out one stream's epochs (made when its reading starts).

    Args:
        buffer: the stream's buffer.
        alive: whether the reader thread still runs.
        evener: how this rank's counts come out equal (None: a single trainer, or ranks
            whose slots need no counting).
        stats: the trainer's figures.
        prep: the stream's frame preparation (its cast warnings are raised here).
        seen: batches handed out, by producer (the stream's ``producers_seen``).
        at: the epoch the stream opens next and its batches yielded before (a resumed
            checkpoint's share).
    """

    def __init__(
        self,
        buffer: Buffer,
        alive: Callable[[], bool],
        evener: Balancer | StaticPads | None,
        stats: TrainerStats,
        prep: FramePrep,
        seen: Counter[str],
        at: tuple[int, int] = (0, 0),
    ) -> None:
        self.buffer = buffer
        self.alive = alive
        self.evener = evener
        self.stats = stats
        self.prep = prep
        self.seen = seen
        self.yielded = 0  # batches handed out
        # The epoch being handed out and its batches handed out so far, run-time pads and
        # a resumed checkpoint's share included: the same on every rank at one step
        # (a state's ``yielding``, consumer/checkpoint.py); and whether it ended.
        self.epoch_yielded = at
        self.epoch_ended = False

    @property
    def padded(self) -> int:
        """Batches yielded a second time to even the ranks' counts (all epochs)."""
        return self.evener.padded if self.evener is not None else 0

    def ledger_held(self, held_back: dict[int, int] | None) -> dict[int, int] | None:
        """``held_back`` (shard -> frames a wrapper holds, the latest it took) less the
        epoch's run-time pads among them: a pad is a batch of the share yielded again,
        not one the ledger hands out (counted as not had, it would be had twice)."""
        pads = self.evener.pad_shards if isinstance(self.evener, Balancer) else []
        if not held_back or not pads or sum(held_back.values()) <= 0:
            return held_back
        held = dict(held_back)
        for shard in pads[-min(sum(held.values()), len(pads)) :]:
            held[shard] = held.get(shard, 0) - 1
        return {shard: n for shard, n in held.items() if n > 0} or None

    def yielding(self, held_back: int) -> tuple[int, int]:
        """(epoch, batches of it yielded), less ``held_back`` frames a wrapper holds; once
        an epoch ended with none held, the next one, none yielded (an epoch re-split for
        another world ends at a count of its own)."""
        epoch, n = self.epoch_yielded
        if self.epoch_ended and not held_back:
            return epoch + 1, 0
        return epoch, n - held_back

    def _publishing(self, epoch: int, frames: Iterator[Frame], evener: Balancer) -> Iterator[Frame]:
        """The rank's own frames of ``epoch`` as they are, before each one the shard
        counts that the ledger came to know since published (every shard before a
        frame's is known by then); the rest once the share ended."""
        since, losses = 0, self.buffer.losses

        def say() -> None:
            nonlocal since, losses
            if self.buffer.losses != losses:  # Redis lost the queue: say them all again
                since, losses = 0, self.buffer.losses
            since, counts = self.buffer.counts_since(since)
            if counts:
                evener.publish_shards(epoch, counts)

        for frame in frames:
            say()
            yield frame
        say()

    def frames(
        self,
        epoch: int,
        *,
        skip_errors: bool,
        queue: str,
        progress: bool,
        total: int | None,
        already: int = 0,
    ) -> Iterator[Frame]:
        """Open ``epoch`` (its count of batches yielded starts now) and yield its frames
        (the epoch begins at the first ``next``).

        Args:
            skip_errors, queue: as :func:`batch_frames`.
            progress: draw a progress bar (of ``total`` batches, if known).
            already: batches of ``epoch`` yielded before the checkpoint resumed from.
        """
        self.epoch_yielded, self.epoch_ended = (epoch, already), False
        return self._frames(epoch, skip_errors, queue, progress, total, already)

    def _frames(
        self,
        epoch: int,
        skip_errors: bool,
        queue: str,
        progress: bool,
        total: int | None,
        already: int,
    ) -> Iterator[Frame]:
        buffer, stats = self.buffer, self.stats
        buffer.start_epoch(epoch)
        stats.start_epoch(epoch)
        bar = EpochProgress(epoch, total) if progress else None
        frames = batch_frames(buffer, self.alive, skip_errors=skip_errors, queue=queue)
        if self.evener is not None:
            self.evener.start_epoch(epoch)
            if isinstance(self.evener, Balancer) and self.evener.publishes(epoch):
                frames = self._publishing(epoch, frames, self.evener)
            frames = self.evener.balance(epoch, frames, buffer.cut_epoch, already)
        handed_out: float | None = None  # when the previous batch left this generator
        try:
            while True:
                asked = time.monotonic()
                frame = next(frames, None)
                if frame is None:
                    stats.end_epoch()
                    self.epoch_ended = True
                    return
                now = time.monotonic()
                busy = asked - handed_out if handed_out is not None else 0.0
                stats.batch(now - asked, busy, frame.nbytes)
                self.seen[frame.producer] += 1
                self.yielded += 1
                self.epoch_yielded = (epoch, self.epoch_yielded[1] + 1)
                if bar is not None:
                    bar.update(stats.snapshot())
                for message in self.prep.take_warnings():
                    warnings.warn(message, UserWarning, stacklevel=3)
                handed_out = time.monotonic()
                yield frame
        finally:
            if bar is not None:
                bar.close()


class EpochProgress:
    """One epoch's bar.

    Args:
        epoch: the epoch's number (for the label).
        total: batches in the epoch, if known.

    Raises:
        ConfigError: rich is not installed.
    """

    def __init__(self, epoch: int, total: int | None) -> None:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        except ImportError as e:  # pragma: no cover - rich is a dependency
            raise ConfigError("progress=True needs the 'rich' package") from e
        self._progress = Progress(
            TextColumn(f"epoch {epoch}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>7.1f} batches/s  stall {task.fields[stall]:>5.1f}%"),
            transient=False,
        )
        self._task = self._progress.add_task("epoch", total=total, rate=0.0, stall=0.0)
        self._progress.start()

    def update(self, figures: dict[str, Any]) -> None:
        """Advance by one batch and show the current rate and stall fraction."""
        self._progress.update(
            self._task,
            advance=1,
            rate=figures["batches_per_s"],
            stall=100 * figures["stall_fraction_epoch"],
        )

    def close(self) -> None:
        """Stop drawing (the last state stays on screen)."""
        self._progress.stop()
