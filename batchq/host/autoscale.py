"""The policy of ``batchq serve --workers auto`` (or ``MIN:MAX``): when to add or retire.

:func:`decide` is pure: it maps what one look at the queue saw (:class:`Figures`) and
what this autoscaler did before (:class:`ScaleState`) to a :class:`Decision`. The loop
that acts on it is :mod:`batchq.host.pool`. The rule, first match wins:

1. below ``min_workers`` (a worker exited, or at start): add up to the minimum; above
   ``max_workers``: retire down to it.
2. while workers this host started have not joined, and within ``cooldown_s`` of its
   last change or of the last of them joining: hold (the figures do not yet show what
   the change did: new workers must start, join and fill the trainer's window).
3. ``input-bound`` and below ``max_workers``: add this host's share of the deficit,
   ``ceil((recommended - alive) / scalers)`` (at least one: the trainer waits, whatever
   the estimate says), but hold when the queue is near its cap right now (the stall
   covers the last 100 batches, which may reach back to waits that are over), when
   the producers are CPU-starved (adding more slowed each of them down), or when the
   host has not the idle CPU the new workers would use
   (their measured use; a pool of mostly-sleeping workers costs next to nothing, and
   up to ``free_cores`` is taken even from a busy host).
4. ``trainer-bound`` with more than ``spare`` producers beyond the recommendation:
   retire this host's share of the excess over ``recommended + spare`` (at least one,
   never below ``min_workers``). Retired workers get SIGTERM and hand their leases back.
5. otherwise hold.

Hysteresis: growing aims at the recommendation (which has a 5% margin) and shrinking
starts only ``spare`` + 1 producers above it, so a pool between the two stays put; a
decision in the direction opposite to the previous one (a reversal) is held until
``reversal_s`` (a minute) has passed since the last reversal.

Several hosts: each looks at the queue's shared figures (producers alive on every
host, the trainer's demand) and acts on its share; a per-queue decision lease in Redis
(:attr:`batchq.protocol.keys.QueueKeys.scale`) lets one autoscaler change its pool at a time
and is held until the workers it started have joined, so that a second host never acts
on figures that do not count the first one's new workers yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchq.errors import ConfigError

__all__ = ["AUTO_MAX_WORKERS", "Decision", "Figures", "ScalePolicy", "ScaleState", "decide"]

#: ``--workers auto`` is ``1:AUTO_MAX_WORKERS`` (the CPU checks bound it further).
AUTO_MAX_WORKERS = 16


@dataclass(frozen=True)
class ScalePolicy:
    """The autoscaler's bounds and tunables.

    Attributes:
        min_workers: workers always running on this host.
        max_workers: workers this host never exceeds.
        auto: whether the pool scales (False: a fixed pool of min_workers).
        cooldown_s: hold after a change until its effect shows in the figures.
        reversal_s: at most one reversal (add after retire, or retire after add) per
            this many seconds.
        spare: producers beyond the recommendation kept before any is retired.
        free_cores: CPU (in cores) new workers may take even from a host with less idle.
    """

    min_workers: int
    max_workers: int
    auto: bool = True
    cooldown_s: float = 5.0
    reversal_s: float = 60.0
    spare: int = 1
    free_cores: float = 0.25

    @classmethod
    def parse(cls, spec: str | int) -> ScalePolicy:
        """Parse ``--workers``: ``N`` (a fixed pool), ``MIN:MAX`` or ``auto``.

        Raises:
            ConfigError: anything else, or bounds that are not 1 <= MIN <= MAX.
        """
        text = str(spec).strip()
        expected = "expected N, MIN:MAX (1 <= MIN <= MAX) or auto"
        if text == "auto":
            return cls(1, AUTO_MAX_WORKERS)
        lo, sep, hi = text.partition(":")
        try:
            low, high = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ConfigError(f"--workers {spec!r} is not valid: {expected}") from None
        if not 1 <= low <= high:
            raise ConfigError(f"--workers {spec!r} is not valid: {expected}")
        return cls(low, high, auto=bool(sep))


@dataclass(frozen=True)
class Figures:
    """What one look at the queue (and this host) saw.

    Attributes:
        verdict: the status verdict ('input-bound', 'trainer-bound', ...).
        alive: producers alive on the queue (every host), plus this host's workers
            started but not yet joined.
        local: this host's running workers.
        recommended: recommended_producers (None: unknown).
        scalers: autoscalers sharing the queue (this one included, at least 1).
        cause: the verdict's cause (e.g. 'cpu-starved') or None.
        idle_cores: the host's idle CPU in cores (None: unknown).
        worker_cores: the CPU one of this host's workers uses (None: not measured yet).
        pending: this host's workers started but not yet joined (counted in alive).
        full: the queue is near its cap right now (:func:`batchq.monitoring.verdict.near_cap`).
        demand: the trainer's demand (batches/s), for the log.
        per_producer: the observed rate of one producer (batches/s), for the log.
    """

    verdict: str
    alive: int
    local: int
    recommended: int | None
    scalers: int = 1
    cause: str | None = None
    idle_cores: float | None = None
    worker_cores: float | None = None
    pending: int = 0
    full: bool = False
    demand: float | None = None
    per_producer: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The figures, for the decision log."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class ScaleState:
    """What this autoscaler did before (updated by :meth:`record`)."""

    last_change_s: float = -math.inf
    last_direction: int = 0
    last_reversal_s: float = -math.inf
    reversals: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"add": 0, "retire": 0})

    pending: bool = False

    def observe(self, f: Figures, now_s: float) -> None:
        """Note what a look saw: the cooldown restarts when the last started worker joined.

        The trainer's figures cover its last 100 batches: they show what new workers do
        only some time after they joined, not after they were started.
        """
        if self.pending and not f.pending:
            self.last_change_s = max(self.last_change_s, now_s)
        self.pending = f.pending > 0

    def record(self, decision: Decision, now_s: float) -> None:
        """Account for a decision that was carried out at ``now_s``."""
        if decision.action == "hold":
            return
        direction = decision.direction
        if self.last_direction and direction != self.last_direction:
            self.last_reversal_s = now_s
            self.reversals += 1
        self.last_direction = direction
        self.last_change_s = now_s
        self.counts[decision.action] += decision.count


@dataclass(frozen=True)
class Decision:
    """One decision: ``action`` ('add', 'retire' or 'hold'), how many, and why."""

    action: str
    count: int
    reason: str

    @property
    def direction(self) -> int:
        """+1 for add, -1 for retire, 0 for hold."""
        return {"add": 1, "retire": -1}.get(self.action, 0)


def _hold(reason: str) -> Decision:
    return Decision("hold", 0, reason)


def _reversal_held(policy: ScalePolicy, state: ScaleState, direction: int, now_s: float) -> bool:
    reversing = state.last_direction not in (0, direction)
    return reversing and now_s - state.last_reversal_s < policy.reversal_s


def _add(policy: ScalePolicy, state: ScaleState, f: Figures, now_s: float) -> Decision:
    deficit = 1 if f.recommended is None else f.recommended - f.alive
    count = min(max(1, math.ceil(deficit / max(1, f.scalers))), policy.max_workers - f.local)
    want = f"recommended {f.recommended}, alive {f.alive}"
    if f.full:
        # The stall covers the trainer's last 100 batches: after it slowed down, those
        # reach back to waits that are over. A full queue says they are.
        return _hold(f"input-bound by its recent figures but the queue is full ({want})")
    if f.cause == "cpu-starved":
        return _hold(f"input-bound but producers are CPU-starved ({want}): not adding")
    if f.idle_cores is not None and f.worker_cores is not None:
        affordable = max(f.idle_cores, policy.free_cores)
        fits = math.floor(affordable / f.worker_cores) if f.worker_cores > 0 else count
        if fits < 1:
            return _hold(
                f"input-bound but the host has {f.idle_cores:.2f} idle cores and a worker "
                f"uses {f.worker_cores:.2f} ({want})"
            )
        count = min(count, fits)
    if _reversal_held(policy, state, 1, now_s):
        return _hold(f"input-bound ({want}) but the last reversal was under "
                     f"{policy.reversal_s:g} s ago")  # fmt: skip
    return Decision("add", count, f"input-bound: {want}, {f.scalers} scaler(s)")


def _retire(
    policy: ScalePolicy, state: ScaleState, f: Figures, recommended: int, now_s: float
) -> Decision:
    excess = f.alive - recommended - policy.spare
    if excess <= 0:
        return _hold(f"trainer-bound with {f.alive} alive for {recommended} "
                     f"recommended: within the spare of {policy.spare}")  # fmt: skip
    count = min(max(1, math.ceil(excess / max(1, f.scalers))), f.local - policy.min_workers)
    if count < 1:
        return _hold(f"trainer-bound but at the minimum of {policy.min_workers}")
    if _reversal_held(policy, state, -1, now_s):
        return _hold("trainer-bound but the last reversal was under "
                     f"{policy.reversal_s:g} s ago")  # fmt: skip
    return Decision("retire", count, f"trainer-bound: recommended {recommended}, "
                    f"alive {f.alive}, spare {policy.spare}")  # fmt: skip


def decide(policy: ScalePolicy, state: ScaleState, f: Figures, now_s: float) -> Decision:
    """Apply the rule in the module docstring; pure (``state`` is not changed).

    Args:
        policy: the bounds and tunables.
        state: this autoscaler's past decisions.
        f: what it saw now.
        now_s: a monotonic time in seconds.

    Returns:
        The decision; carry it out, then call ``state.record(decision, now_s)``.
    """
    if f.local < policy.min_workers:
        return Decision("add", policy.min_workers - f.local, f"below the minimum of "
                        f"{policy.min_workers}")  # fmt: skip
    if f.local > policy.max_workers:
        return Decision("retire", f.local - policy.max_workers, f"above the maximum of "
                        f"{policy.max_workers}")  # fmt: skip
    if not policy.auto:
        return _hold("a fixed pool")
    if f.pending:
        return _hold(f"waiting for {f.pending} started worker(s) to join")
    if now_s - state.last_change_s < policy.cooldown_s:
        return _hold("cooling down after the last change")
    if f.verdict == "input-bound":
        if f.local >= policy.max_workers:
            return _hold(f"input-bound but at the maximum of {policy.max_workers}")
        return _add(policy, state, f, now_s)
    if f.verdict == "trainer-bound" and f.recommended is not None:
        return _retire(policy, state, f, f.recommended, now_s)
    return _hold(f"{f.verdict}: nothing to change")
