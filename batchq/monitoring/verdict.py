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

A rank of a data-parallel run has one more (:mod:`batchq.monitoring.reader_rows`):
``unread``, its list near its cap with no trainer attached to it while another rank
reads: its share of the epoch goes unread (a wrapper that reads on one rank and
scatters, a rank that never started).

When it can, :func:`cause` names why the trainer is input-bound (first match wins):

- ``slow-producer``: one producer builds under half the median rate of the others. It
  comes first: a slow producer also holds the others back at the look-ahead window,
  which would otherwise look like a transport shortfall.
- ``cpu-starved``: in the stored history, the per-producer pipeline rate at the largest
  producer count is under :data:`STARVED_DROP` of the rate at the smallest: adding
  producers slowed every one of them (they share the host's CPUs).
- ``transport-saturated``: the producers could build far more than reaches the queue
  (their pipelines' summed rate is at least 1/:data:`TRANSPORT_SHORTFALL` times what
  was pushed) while the queue stays low (median under 1/4 of the hwm): the time goes
  into Redis or the network, not into building, so more producers will not help.

The producers' blocked time is shown but not used: it is cumulative over each
producer's life, so it cannot say what is happening now. History samples carry the
trainer's wall time and "now" is the Redis server's: a trainer whose clock is off by
more than RECENT_S contributes no samples, and the depth is then this read's alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from batchq.monitoring.sizing import sample_rate
from batchq.protocol.fields import HistoryField

__all__ = [
    "CAUSES",
    "FIGURES_FRESH_S",
    "RECENT_S",
    "STALL_INPUT_BOUND",
    "STARVED_DROP",
    "TRANSPORT_SHORTFALL",
    "VERDICTS",
    "cause",
    "figures_fresh",
    "judge",
    "near_cap",
    "recent_depths",
]

#: The trainer's stall fraction at and above which the pipeline is input-bound.
STALL_INPUT_BOUND = 0.10
#: The trainer writes its figures about once a second while it pops; older ones are stale.
FIGURES_FRESH_S = 10.0


def figures_fresh(age_s: float | None) -> bool:
    """Whether a trainer's figures of that age (None: none sent) are recent enough to
    judge by (:data:`FIGURES_FRESH_S`)."""
    return age_s is not None and age_s <= FIGURES_FRESH_S


#: How far back history samples count as "recent" for the depth median.
RECENT_S = 15.0
#: Every verdict judge() may return.
VERDICTS = ("input-bound", "trainer-bound", "balanced", "idle", "unknown", "unread")
#: Every cause cause() may return.
CAUSES = ("transport-saturated", "cpu-starved", "slow-producer")
#: Delivered under this fraction of the pipelines' summed rate: the transport is the limit.
TRANSPORT_SHORTFALL = 0.6
#: Per-producer rate at the most producers under this fraction of that at the fewest.
STARVED_DROP = 0.8


def recent_depths(depth: float, history: Sequence[dict[str, Any]], now_s: float) -> list[float]:
    """``depth`` and the depths of the history samples of the last RECENT_S before
    ``now_s`` (what :func:`judge` takes)."""
    out = [float(depth)]
    for sample in history:
        t, d = sample.get(HistoryField.T), sample.get(HistoryField.DEPTH)
        if isinstance(t, int | float) and isinstance(d, int | float) and t >= now_s - RECENT_S:
            out.append(float(d))
    return out


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
    depth, at = _queue_at(depths, hwm)
    if trainer != "attached":
        return _idle(trainer, producers_alive, at)
    return _attached(producers_alive, depth, hwm, stall, at)


def _attached(
    producers_alive: int, depth: float, hwm: int, stall: float | None, at: str
) -> tuple[str, str]:
    """The verdict while a trainer is attached (rules 2-6), at the median ``depth``."""
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


def _median(depths: Sequence[float]) -> float:
    return statistics.median(depths) if depths else 0.0


def _queue_at(depths: Sequence[float], hwm: int) -> tuple[float, str]:
    """The median depth, and where the queue is, for the reasons: 'queue recently at 3/8'."""
    depth = _median(depths)
    at = "queue at" if len(depths) < 2 else "queue recently at"
    at += f" {depth:g}/{hwm}" if hwm else f" {depth:g}"
    return depth, at


def _idle(trainer: str, producers_alive: int, at: str) -> tuple[str, str]:
    """The verdict while no trainer is attached (rule 1)."""
    if trainer == "finished":
        return "idle", "the run finished"
    who = f"{producers_alive} producer{'s' if producers_alive != 1 else ''} alive"
    return "idle", f"no trainer attached ({who}, {at})"


def _rates_by_count(samples: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per-producer pipeline rate for each producer count seen in the samples."""
    out: dict[int, float] = {}
    prev: int | None = None
    segment: list[dict[str, Any]] = []
    for s in [*samples, {}]:  # the sentinel closes the last run
        n = s.get(HistoryField.PRODUCERS)
        n = n if isinstance(n, int) and not isinstance(n, bool) else None
        if n != prev and segment:
            if prev is not None and prev > 0:
                rate = sample_rate(segment)
                if rate is not None:
                    out[prev] = rate
            segment = []
        segment.append(s)
        prev = n
    return out


def cause(
    *,
    verdict: str,
    depths: Sequence[float],
    hwm: int,
    producers: Sequence[dict[str, Any]],
    samples: Sequence[dict[str, Any]],
    supply: float | None,
    delivered: float | None,
) -> tuple[str, str] | None:
    """Why the trainer is input-bound, when the figures say (the rule in the module doc).

    Args:
        verdict: what :func:`judge` returned; causes are named for 'input-bound' only.
        depths: recent depth samples.
        hwm: the run's cap.
        producers: the status rows' producer objects (``id``, ``batches_per_s``).
        samples: history samples, newest first (with ``producers``, ``built``,
            ``build_ms``).
        supply: the live producers' summed pipeline rate.
        delivered: frames pushed per second recently.

    Returns:
        (cause, sentence) with cause one of :data:`CAUSES`, or None.
    """
    if verdict != "input-bound":
        return None
    depth = _median(depths)
    return (
        _slow_producer(producers)
        or _cpu_starved(samples)
        or _transport_saturated(supply, delivered, depth, hwm)
    )


def _slow_producer(producers: Sequence[dict[str, Any]]) -> tuple[str, str] | None:
    """'slow-producer': one builds under half the median rate of the others."""
    rated = sorted(
        (p["batches_per_s"], p["id"]) for p in producers if p.get("batches_per_s") is not None
    )
    if len(rated) < 2:
        return None
    slowest, pid = rated[0]
    others = statistics.median(r for r, _ in rated[1:])
    if slowest >= 0.5 * others:
        return None
    return "slow-producer", (
        f"producer {pid} builds {slowest:.1f} batches/s, under half the others' {others:.1f}/s"
    )


def _cpu_starved(samples: Sequence[dict[str, Any]]) -> tuple[str, str] | None:
    """'cpu-starved': each producer is slower at the largest count than at the smallest."""
    by_count = _rates_by_count(samples)
    if len(by_count) < 2:
        return None
    few, many = min(by_count), max(by_count)
    if by_count[many] >= STARVED_DROP * by_count[few]:
        return None
    return "cpu-starved", (
        f"each producer built {by_count[few]:.1f} batches/s with {few} and "
        f"{by_count[many]:.1f}/s with {many}: they compete for their host's CPU"
    )


def _transport_saturated(
    supply: float | None, delivered: float | None, depth: float, hwm: int
) -> tuple[str, str] | None:
    """'transport-saturated': far less reaches the queue than the producers could build,
    and the queue stays low."""
    if supply is None or delivered is None:
        return None
    if delivered >= TRANSPORT_SHORTFALL * supply or depth >= max(1.0, hwm / 4):
        return None
    return "transport-saturated", (
        f"producers could build {supply:.1f} batches/s but only {delivered:.1f}/s reach "
        "the queue, which stays low: Redis or the network is the limit, not the producers"
    )
