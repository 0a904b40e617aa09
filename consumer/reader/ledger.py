"""The trainer's ledger: which batches of which shards it has, and what comes next.

Frames arrive in any order, possibly twice (a redone shard), possibly from an older run;
the ledger keeps one copy of each address (epoch, shard, k), knows when a shard is
complete (its last frame says how many batches it has, and all of them arrived) and
when an epoch is complete (all S shards are), and hands the frames out in plan order
(``ordered=True``) or in arrival order (each shard's batches still as a prefix). Frames
past the look-ahead window are not filed (:meth:`Ledger.ahead`): the run builds them
again once the window reaches them.

It is plain data, used under the reader's lock; it never touches Redis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from batchq.protocol.layout import DONE, ledger_field, parse_ledger_field
from batchq.protocol.ranks import RankLayout
from batchq.wire.codec import Frame, FrameKind
from consumer.reader.shard_state import ShardState, why_impossible

__all__ = ["Ledger", "global_pairs"]


class Ledger:
    """Assembles epochs from frames.

    Args:
        shards: S, the number of shards per epoch.
        ordered: hand frames out in plan order (else in arrival order).
        first_epoch: the first epoch the trainer will ask for.
    """

    def __init__(self, shards: int, *, ordered: bool = True, first_epoch: int = 0) -> None:
        self.shards = shards
        self.ordered = ordered
        self.epoch = first_epoch  # the epoch being handed out
        self._cut = False  # the epoch was cut short (data-parallel 'drop')
        self._epochs: dict[int, dict[int, ShardState]] = {}
        self._cursor = (0, 0)  # ordered mode: next (shard, k) to hand out
        self._arrived: deque[Frame] = deque()  # arrival mode: frames of self.epoch
        self.buffered = 0  # frames held and not handed out
        # Kept up to date so that floor() and epoch_done() cost O(1) per batch, not O(S).
        self._complete: dict[int, int] = {}  # epoch -> shards complete
        self._counted: dict[int, list[int]] = {}  # epoch -> shards as their counts came
        self._held: dict[int, int] = {}  # epoch -> frames held
        self._floor = first_epoch * shards
        self._base = first_epoch * shards  # see base()
        self._published = first_epoch * shards  # see window_base()
        self.duplicates = 0
        self.stale = 0
        self.skipped = 0  # shards given up on (ERROR frames under the skip policy)
        # Frames of the run past the look-ahead window, dropped (see ahead()).
        self.dropped_ahead = 0
        # What the run's plan says (set once it is known): frames outside the plan are
        # impossible, frames past the window are dropped, which keeps the buffer within
        # the window whatever is pushed.
        self.window: int | None = None
        self.epoch_batches: int | None = None
        # Frames held that a later frame proved impossible (k past the shard's count):
        # dropped here, handed to the reader for the dead list.
        self.purged: list[tuple[Frame, str]] = []

    def _shard(self, epoch: int, shard: int) -> ShardState:
        return self._epochs.setdefault(epoch, {}).setdefault(shard, ShardState())

    def add(self, frame: Frame) -> bool:
        """Take one frame; False if it was dropped (duplicate, old epoch, bad address)."""
        if frame.epoch < self.epoch or not 0 <= frame.shard < self.shards:
            self.stale += 1
            return False
        state = self._shard(frame.epoch, frame.shard)
        was_complete = state.complete
        try:
            return self._add(state, frame)
        finally:
            self._note(frame.epoch, state, was_complete)

    def impossible(self, frame: Frame) -> str | None:
        """Why a frame cannot be one batchq's producers wrote for this run, or None.

        Its count must fit its position (a last batch at k counts k + 1 batches, an END
        or ERROR at k counts k), it must lie within the plan's batches per epoch, and fit
        what the shard's last frame already said (the rules:
        :func:`consumer.reader.shard_state.why_impossible`). A frame past the look-ahead
        window is not impossible (see :meth:`ahead`).
        """
        state = self._epochs.get(frame.epoch, {}).get(frame.shard)
        return why_impossible(frame, self.epoch_batches, None if state is None else state.count)

    def ahead(self, frame: Frame) -> bool:
        """Whether a frame lies past the look-ahead window above the floor: it is then
        dropped (the caller counts it in :attr:`dropped_ahead`), never filed.

        The run can deliver such a frame: a shard that a producer leased under a floor
        further ahead (a crashed trainer's) or before a resume moved the floor back comes
        back through the work list, which ignores the window. It is not needed yet, and
        holding it would let the buffer grow past the window. It is not lost either:
        producers mint only below the published floor plus the window, so a shard past
        the window has not been minted yet, and it is built again once the window
        reaches it.
        """
        if not self.window or frame.epoch < self.epoch or not 0 <= frame.shard < self.shards:
            return False  # no window known yet, or stale (add counts those)
        return frame.epoch * self.shards + frame.shard >= self.window_base() + self.window

    def _note(self, epoch: int, state: ShardState, was_complete: bool) -> None:
        if state.complete and state.error is None and not was_complete:
            self._complete[epoch] = self._complete.get(epoch, 0) + 1

    def _add(self, state: ShardState, frame: Frame) -> bool:
        if frame.kind == FrameKind.ERROR:
            if state.error is None and not state.complete:
                state.error = frame
                return True
            self.duplicates += 1
            return False
        if frame.last and frame.count is not None:
            if state.count is None:
                self._counted.setdefault(frame.epoch, []).append(frame.shard)
            state.count = frame.count
            self._purge(frame.epoch, state)
        if frame.kind == FrameKind.END:
            state.end = frame
            return True
        if frame.k in state.received:
            self.duplicates += 1
            return False
        state.received.add(frame.k)
        state.frames[frame.k] = frame
        self.buffered += 1
        self._held[frame.epoch] = self._held.get(frame.epoch, 0) + 1
        if not self.ordered and frame.epoch == self.epoch:
            self._arrived.append(frame)
        return True

    def _purge(self, epoch: int, state: ShardState) -> None:
        """Drop held frames at or past the shard's count (impossible ones that came first)."""
        count = state.count or 0
        for k in [k for k in state.frames if k >= count]:
            frame = state.frames.pop(k)
            self.buffered -= 1
            self._held[epoch] -= 1
            if not self.ordered and frame in self._arrived:
                self._arrived.remove(frame)
            self.purged.append((frame, f"k {k} is past the shard's {count} batches"))
        state.received = {k for k in state.received if k < count or k < state.skip}

    def preload(self, epoch: int, shard: int, had: int, *, done: bool) -> None:
        """Mark the first ``had`` batches of a shard as handed out already (a resume).

        Args:
            done: the shard had exactly ``had`` batches: it is complete.
        """
        state = self._shard(epoch, shard)
        was_complete = state.complete
        state.skip = had
        state.received.update(range(had))
        if done:
            state.count = had
            self._counted.setdefault(epoch, []).append(shard)
        self._note(epoch, state, was_complete)

    def consumed(
        self, held_back: dict[int, int] | None = None
    ) -> tuple[int, dict[int, int], list[int]]:
        """What the caller has been handed: (epoch, batches per shard, shards done).

        If the current epoch was handed out completely, that is the next epoch, empty.

        Args:
            held_back: shard -> batches of the current epoch handed out to a wrapper
                that prefetches (the torch adapter) and not yet to its caller: they
                count as not consumed.
        """
        held_back = held_back or {}
        if self.epoch_done() and not held_back:
            return self.epoch + 1, {}, []
        counts: dict[int, int] = {}
        done: list[int] = []
        for shard, state in sorted(self._epochs.get(self.epoch, {}).items()):
            n = state.skip + state.given - held_back.get(shard, 0)
            if n:
                counts[shard] = n
            if state.count is not None and n >= state.count and state.error is None:
                counts[shard] = state.count
                done.append(shard)
        return self.epoch, counts, done

    def counts_since(self, since: int) -> tuple[int, dict[int, int]]:
        """(a cursor past them, shard -> batches) of the current epoch's shards whose
        counts came to be known after cursor ``since`` (0: the epoch's first): a shard's
        last frame or END arrived, a shard skipped on an error (the batches before it), a
        resume's done shard. Every shard before one a frame is handed out of is known."""
        shards, states = self._counted.get(self.epoch, []), self._epochs.get(self.epoch, {})
        out = {}
        for shard in shards[since:]:
            state = states.get(shard)
            if state is not None and state.count is not None and state.error is None:
                out[shard] = state.count
        return len(shards), out

    def received_pairs(self) -> list[tuple[str, str]]:
        """What has arrived, for every epoch from the current one on, as ledger pairs.

        Each shard reads ``'<epoch>:<shard>'`` -> ``'d'`` (complete) or the number of
        leading batches that arrived. Handed to Redis when it lost the queue's state, so
        producers build only what is missing.
        """
        pairs = []
        for epoch in sorted(e for e in self._epochs if e >= self.epoch):
            for shard, state in sorted(self._epochs[epoch].items()):
                if state.complete and state.error is None:
                    pairs.append((ledger_field(epoch, shard), DONE))
                elif state.prefix:
                    pairs.append((ledger_field(epoch, shard), str(state.prefix)))
        return pairs

    def skip_error(self, frame: Frame) -> None:
        """Treat an ERROR frame as its shard's end: the batches before it are all it has."""
        state = self._shard(frame.epoch, frame.shard)
        if state.error is frame:
            state.error = None
            state.count = frame.count or 0
            self._counted.setdefault(frame.epoch, []).append(frame.shard)
            # Batches past the failure point (from another attempt) are not part of it.
            for k in [k for k in state.frames if k >= state.count]:
                del state.frames[k]
                self.buffered -= 1
                self._held[frame.epoch] -= 1
            state.received = {k for k in state.received if k < state.count}
            self._note(frame.epoch, state, False)
            self.skipped += 1

    def start_epoch(self, epoch: int) -> None:
        """Begin handing out ``epoch``; frames of earlier epochs are dropped."""
        for e in [e for e in self._epochs if e < epoch]:
            for state in self._epochs.pop(e).values():
                self.buffered -= len(state.frames)
            self._held.pop(e, None)
            self._complete.pop(e, None)
            self._counted.pop(e, None)
        self.epoch = epoch
        self._cut = False
        self._cursor = (0, 0)
        self._arrived.clear()
        if not self.ordered:
            for s in range(self.shards):
                held = self._epochs.get(epoch, {}).get(s)
                if held is not None:
                    self._arrived.extend(held.frames[k] for k in sorted(held.frames))

    def next_frame(self) -> Frame | None:
        """The next frame to hand out in the current epoch, or None if it has not arrived.

        An ERROR frame is returned when the failing shard is reached (ordered) or at once
        (arrival order); the caller raises it. Call :meth:`epoch_done` to tell the end.
        """
        return self._find(take=True)

    def next_frame_ready(self) -> bool:
        """True if :meth:`next_frame` would return a frame now."""
        return self._find(take=False) is not None

    def _find(self, *, take: bool) -> Frame | None:
        states = self._epochs.get(self.epoch, {})
        if self.ordered:
            return self._find_ordered(states, take=take)
        for state in states.values():
            if state.error is not None:
                return state.error
        return self._find_arrived(states, take=take)

    def _find_ordered(self, states: dict[int, ShardState], *, take: bool) -> Frame | None:
        """Plan order: the frame at the cursor (an ERROR frame once its shard's batches
        before it were handed out), moving the cursor past complete shards."""
        shard, k = self._cursor
        while shard < self.shards:
            current = states.get(shard)
            if current is None:
                return None
            k = max(k, current.skip)
            if current.error is not None and k >= (current.error.count or 0):
                return current.error
            if current.count is not None and k >= current.count:
                shard, k = shard + 1, 0
                self._cursor = (shard, k)
                continue
            found = current.frames.get(k)
            if found is None:
                return None
            if take:
                self._take(current, k)
                self._cursor = (shard, k + 1)
            return found
        return None

    def _find_arrived(self, states: dict[int, ShardState], *, take: bool) -> Frame | None:
        """Arrival order: the first frame that arrived whose shard's earlier batches were
        all handed out. A shard's batches go out as a prefix, which is what
        :meth:`consumed` counts: a frame whose predecessors were dropped (past the window,
        a bad frame) waits for the shard's rebuild to bring them."""
        for i, frame in enumerate(self._arrived):
            state = states.get(frame.shard)
            if state is None or state.frames.get(frame.k) is not frame:
                continue  # no longer held (skip_error cut it): nothing to hand out
            if frame.k != state.skip + state.given:
                continue
            if take:
                del self._arrived[i]
                self._take(state, frame.k)
            return frame
        return None

    def _take(self, state: ShardState, k: int) -> None:
        del state.frames[k]
        state.given += 1
        self.buffered -= 1
        self._held[self.epoch] -= 1

    def epoch_done(self) -> bool:
        """True when every shard of the current epoch is complete and handed out, or the
        epoch was cut short (:meth:`cut_epoch`)."""
        return self._cut or (
            self._complete.get(self.epoch, 0) >= self.shards and self._held.get(self.epoch, 0) == 0
        )

    def cut_epoch(self) -> None:
        """End the current epoch here: a data-parallel rank cut its share to the
        shortest (``even_batches='drop'``); the rest is never handed out."""
        self._cut = True

    def incomplete(self, first: int, count: int) -> list[int]:
        """Global shard numbers in [first, first + count) not complete in the ledger."""
        out = []
        for g in range(first, first + count):
            epoch, shard = divmod(g, self.shards)
            state = self._epochs.get(epoch, {}).get(shard)
            if epoch >= self.epoch and (state is None or not state.complete):
                out.append(g)
        return out

    def missing_shards(self, epoch: int | None = None) -> list[int]:
        """The shards of ``epoch`` (default: the current one) that are not complete."""
        states = self._epochs.get(self.epoch if epoch is None else epoch, {})
        return [s for s in range(self.shards) if s not in states or not states[s].complete]

    def floor(self) -> int:
        """The oldest incomplete shard, as a global shard number (epoch * S + shard).

        Completion only moves forward (but where :meth:`purge` took frames, which moves
        this back), so this resumes from where it last stopped.
        """
        self._floor = self._first(max(self._floor, self.epoch * self.shards), False)
        return self._floor

    def base(self) -> int:
        """The oldest shard not complete or not handed out completely: the trainer's
        position in shards (it only moves forward)."""
        self._base = self._first(max(self._base, self.epoch * self.shards), True)
        return self._base

    def _first(self, g: int, handed_out: bool) -> int:
        """The first shard from g on that is not complete (or, ``handed_out``, not
        handed out completely)."""
        while True:
            state = self._epochs.get(g // self.shards, {}).get(g % self.shards)
            if state is None or not state.complete or state.error is not None:
                return g
            if handed_out and not state.handed_out:
                return g
            g += 1

    def window_base(self) -> int:
        """The look-ahead window's base, published as the trainer's floor: :meth:`floor`,
        but at most the window past the position (:meth:`base`); it only moves forward.
        So producers never build more than two windows past the position: the fixed
        look-ahead of ``set_params`` (:func:`batchq.protocol.ranks.lookahead_batches`).
        """
        floor = self.floor()
        if self.window:
            floor = min(floor, self.base() + self.window)
        self._published = max(self._published, floor)
        return self._published

    def purge(self, stale: Callable[[int, Frame], bool]) -> list[tuple[int, int, int, int]]:
        """Drop the frames held (not handed out) that ``stale(epoch, frame)`` says were
        built with params since changed; their shards are built again.

        Returns:
            (epoch, shard, batches kept: the prefix the trainer still has, frames
            dropped) per shard that lost frames.
        """
        out = []
        for epoch, states in sorted(self._epochs.items()):
            for shard, state in sorted(states.items()):
                was_complete = state.complete
                dropped, changed = state.drop(lambda f, e=epoch: stale(e, f))  # type: ignore[misc]
                if not changed:
                    continue
                for frame in dropped:
                    self.buffered -= 1
                    self._held[epoch] -= 1
                    if frame in self._arrived:
                        self._arrived.remove(frame)
                if was_complete and not state.complete:
                    self._complete[epoch] -= 1
                self._floor = min(self._floor, epoch * self.shards + shard)
                out.append((epoch, shard, state.prefix, len(dropped)))
        return out

    def held_frames(self) -> list[Frame] | None:
        """The frames held and not handed out, in plan order (each shard's END frame
        after its batches), for a trainer that detaches to give back; None where a held
        ERROR frame is not handed out yet (its shard is built again instead)."""
        out: list[Frame] = []
        for _, states in sorted(self._epochs.items()):
            for _, state in sorted(states.items()):
                if state.handed_out and state.count is not None:
                    continue
                if state.error is not None:
                    return None
                out += [state.frames[k] for k in sorted(state.frames)]
                if state.end is not None:
                    out.append(state.end)
        return out

    def prefix(self, epoch: int, shard: int) -> int:
        """The leading batches of a shard the trainer has (handed out or held)."""
        state = self._epochs.get(epoch, {}).get(shard)
        return 0 if state is None else state.prefix

    def needs_more(self) -> bool:
        """True if the next frame to hand out has not arrived (pop even past the hwm)."""
        return self._find(take=False) is None and not self.epoch_done()


def global_pairs(
    pairs: list[tuple[str, str]], layout: RankLayout | None, rank: int
) -> list[tuple[str, str]]:
    """Ledger pairs of local shards ('<epoch>:<j>') as Redis names them (slots)."""
    if layout is None:
        return pairs
    out = []
    for field, value in pairs:
        epoch, local = parse_ledger_field(field)
        out.append((ledger_field(epoch, layout.slot(local, rank)), value))
    return out
