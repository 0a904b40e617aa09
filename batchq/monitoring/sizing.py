"""How many producers a queue needs: the trainer's demand against the producers' supply.

Pure arithmetic on figures batchq already records, so that ``status``, ``top``, the
exporter, ``report`` and the autoscaler (:mod:`batchq.host.autoscale`) agree. Every function
takes plain numbers (not a snapshot), so that the same figures can later be computed per
rank from per-rank inputs.

- **demand** (batches/s the trainer would take if it never waited): the trainer's recent
  rate divided by the fraction of its time it was busy, ``batches_per_s / (1 - stall)``;
  that is one over its busy time per batch. Unknown while the trainer waits nearly all
  the time (:data:`MIN_BUSY_FRACTION`): its busy time is then too small to measure.
- **per-producer rate** (batches/s of pipeline time, blocked time excluded): over the
  recent history samples when there are two (``built`` and ``build_ms``: the live
  producers' totals, which the pop script adds to each sample), else the live
  producers' lifetime totals. Weighted by producer time, so one slow producer counts as
  what it costs.
- **supply**: the sum of the live producers' pipeline rates (what they could deliver),
  and **delivered**: frames actually pushed per second over the recent samples.
- **recommended_producers**: ``ceil(demand / per-producer rate x (1 + margin))``, at
  least 1; :data:`RECOMMEND_MARGIN` covers the jitter of the pipeline's rate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from batchq.protocol.fields import HistoryField as H

__all__ = [
    "MIN_BUSY_FRACTION",
    "RECOMMEND_MARGIN",
    "busy_ms_per_batch",
    "delivered_rate",
    "demand_rate",
    "producer_rate",
    "ratio",
    "recent_samples",
    "recommended_producers",
    "sample_rate",
]

#: Headroom of the recommendation over the bare need (5%: a pool of exactly the need
#: runs the trainer within a few % of its floor; more would overshoot by one producer
#: whenever the need is close to an integer).
RECOMMEND_MARGIN = 0.05
#: Below this busy fraction (the trainer waits over 99.5% of its time) the demand is not
#: computed: the busy time per batch is then within the timer's noise.
MIN_BUSY_FRACTION = 0.005


def ratio(num: float, den: float) -> float | None:
    """``num / den``, None when ``den`` is not positive."""
    return num / den if den > 0 else None


def demand_rate(batches_per_s: float | None, stall: float | None) -> float | None:
    """Batches/s the trainer would take if it never waited, None when unknown.

    Args:
        batches_per_s: the trainer's recent rate (its figures' ``batches_per_s``).
        stall: the fraction of that time it waited for data.
    """
    if batches_per_s is None or stall is None or batches_per_s <= 0:
        return None
    busy = 1.0 - stall
    if busy < MIN_BUSY_FRACTION:
        return None
    return batches_per_s / busy


def busy_ms_per_batch(batches_per_s: float | None, stall: float | None) -> float | None:
    """The trainer's own work per batch in ms (1000 / demand), None when unknown."""
    demand = demand_rate(batches_per_s, stall)
    return None if demand is None else 1000.0 / demand


def recent_samples(history: Sequence[dict[str, Any]], since_s: float) -> list[dict[str, Any]]:
    """The history samples (newest first) whose time ``t`` is at least ``since_s``."""
    out = []
    for s in history:
        t = s.get(H.T)
        if isinstance(t, int | float) and not isinstance(t, bool) and t >= since_s:
            out.append(s)
    return out


def _num(sample: dict[str, Any], name: str) -> float | None:
    v = sample.get(name)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def sample_rate(samples: Sequence[dict[str, Any]]) -> float | None:
    """Per-producer pipeline rate over samples (newest first): 1000 x d built / d build_ms.

    Sums the differences of consecutive samples, skipping a step in which a producer
    left (its totals leave the sums, so that step's differences mean nothing). None
    when no step has the fields or none built anything.
    """
    d_built = d_ms = 0.0
    for newer, older in itertools.pairwise(samples):
        step = _build_step(newer, older)
        if step is not None:
            d_built += step[0]
            d_ms += step[1]
    return 1000.0 * d_built / d_ms if d_built > 0 and d_ms > 0 else None


def _build_step(newer: dict[str, Any], older: dict[str, Any]) -> tuple[float, float] | None:
    """(batches built, pipeline ms) between two consecutive samples; None for a step
    without the fields, in which a producer left, or in which the totals went back."""
    b1, m1, b0, m0 = (
        _num(newer, H.BUILT),
        _num(newer, H.BUILD_MS),
        _num(older, H.BUILT),
        _num(older, H.BUILD_MS),
    )
    n1, n0 = _num(newer, H.PRODUCERS) or 0.0, _num(older, H.PRODUCERS) or 0.0
    if b1 is None or m1 is None or b0 is None or m0 is None or n1 < n0:
        return None
    if not (b1 >= b0 and m1 >= m0):
        return None
    return b1 - b0, m1 - m0


def producer_rate(samples: Sequence[dict[str, Any]], built: int, build_ms: int) -> float | None:
    """The observed pipeline rate of one producer (batches/s), None when unknown.

    Args:
        samples: recent history samples, newest first (see :func:`recent_samples`).
        built: the live producers' batches (lifetime), the fallback.
        build_ms: the live producers' pipeline time (lifetime, ms), the fallback.
    """
    rate = sample_rate(samples)
    if rate is not None:
        return rate
    return 1000.0 * built / build_ms if built > 0 and build_ms > 0 else None


def delivered_rate(samples: Sequence[dict[str, Any]]) -> float | None:
    """Frames pushed per second between the oldest and newest sample, None if unknown."""
    if len(samples) < 2:
        return None
    p1, t1, p0, t0 = (
        _num(samples[0], H.PUSHED),
        _num(samples[0], H.T),
        _num(samples[-1], H.PUSHED),
        _num(samples[-1], H.T),
    )
    if p1 is None or t1 is None or p0 is None or t0 is None or t1 <= t0 or p1 < p0:
        return None
    return (p1 - p0) / (t1 - t0)


def recommended_producers(
    demand: float | None, per_producer: float | None, margin: float = RECOMMEND_MARGIN
) -> int | None:
    """Producers that meet ``demand`` at ``per_producer`` batches/s each, with a margin.

    Returns:
        At least 1, or None when either figure is unknown.
    """
    if demand is None or per_producer is None or per_producer <= 0:
        return None
    # Round first, so that a need of exactly 4.0 x 1.05 is not pushed up by float noise.
    return max(1, math.ceil(round(demand / per_producer * (1.0 + margin), 6)))
