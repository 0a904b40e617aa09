"""Is the trainer waiting for data, or are the producers waiting for the trainer?

The rule (:func:`judge`), first match wins:

1. ``idle``: the run finished, or no trainer holds the queue. Nothing is being consumed,
   so nothing can be bound.
2. ``input-bound``: the trainer is attached and no producer is alive while the queue is
   empty: it will wait for ever.
3. ``unknown``: the trainer has not reported figures recently (:data:`FIGURES_FRESH_S`)
   and the queue is not near its cap: a trainer that just started.
4. ``input-bound``: the trainer waited for data at least :data:`STALL_INPUT_BOUND` (10%)
   of its recent time (its last 100 batches). Below that, waits are the noise of
   handing a frame from the reader thread and of the trainer's own jitter (a trainer fed
   from a full queue measures 0-2%); at 10% more producers buy a visible speed-up
   (1.1x), which is the question the verdict answers.
5. ``trainer-bound``: the queue sits near its cap: the median depth of the recent
   samples (the trainer's history of the last :data:`RECENT_S` seconds and this read)
   is at least 3/4 of the hwm, or within one frame of it for caps under 4
   (:func:`near_cap`). When the trainer is the bottleneck every freed slot is refilled
   by the next push, so the list sits at hwm or hwm - 1, and producers block; a median
   below 3/4 means they are mostly not blocked.
6. ``balanced``: the trainer rarely waits and the producers are rarely blocked: both
   sides run at about the same rate (the cheapest configuration that does not stall).

The producers' blocked time is shown but not used: it is cumulative over each
producer's life, so it cannot say what is happening now. History samples carry the
trainer's wall time and "now" is the Redis server's: a trainer whose clock is off by
more than RECENT_S contributes no samples, and the depth is then this read's alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = [
    "FIGURES_FRESH_S",
    "RECENT_S",
    "STALL_INPUT_BOUND",
    "VERDICTS",
    "judge",
    "near_cap",
]

#: The trainer's stall fraction at and above which the pipeline is input-bound.
STALL_INPUT_BOUND = 0.10
#: The trainer writes its figures about once a second while it pops; older ones are stale.
FIGURES_FRESH_S = 10.0
#: How far back history samples count as "recent" for the depth median.
RECENT_S = 15.0
#: Every verdict judge() may return.
VERDICTS = ("input-bound", "trainer-bound", "balanced", "idle", "unknown")


def near_cap(depth: float, hwm: int) -> bool:
    """Whether ``depth`` is at least 3/4 of ``hwm``, or within one frame of it (hwm < 4)."""
    if hwm <= 0:
        return False
    return depth >= max(1.0, min(0.75 * hwm, hwm - 1))


def judge(
    *,
    trainer: str,
    producers_alive: int,
    depths: Sequence[float],
    hwm: int,
    stall: float | None,
) -> tuple[str, str]:
    """Apply the rule in the module docstring.

    Args:
        trainer: 'attached', 'detached' or 'finished'.
        producers_alive: producers whose heartbeat has not lapsed.
        depths: recent depth samples, this read's included (at least one).
        hwm: the run's cap (0 if unknown).
        stall: the trainer's recent stall fraction, None when it is stale or missing.

    Returns:
        (verdict, reason): one of :data:`VERDICTS` and a sentence saying why.
    """
    depth = statistics.median(depths) if depths else 0.0
    at = "queue at" if len(depths) < 2 else "queue recently at"
    at += f" {depth:g}/{hwm}" if hwm else f" {depth:g}"
    if trainer == "finished":
        return "idle", "the run finished"
    if trainer != "attached":
        who = f"{producers_alive} producer{'s' if producers_alive != 1 else ''} alive"
        return "idle", f"no trainer attached ({who}, {at})"
    if producers_alive == 0 and depth == 0:
        return "input-bound", f"no producer alive and the queue is empty: the trainer waits ({at})"
    if stall is None and not near_cap(depth, hwm):
        return "unknown", f"the trainer has not reported figures recently ({at})"
    if stall is not None and stall >= STALL_INPUT_BOUND:
        return "input-bound", f"the trainer waits for data {100 * stall:.0f}% of its time ({at})"
    if near_cap(depth, hwm):
        waits = "" if stall is None else f", the trainer waits {100 * stall:.0f}% of its time"
        return "trainer-bound", f"{at}: producers wait for the trainer{waits}"
    pct = 100 * (stall or 0.0)
    return "balanced", f"the trainer waits {pct:.0f}% of its time; producers keep up ({at})"
