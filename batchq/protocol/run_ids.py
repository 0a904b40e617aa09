"""A run's id, minted in one place: 16 hex digits, fresh or derived.

A fresh run (a producer or a trainer starting one) gets a random id. The processes that
must meet in one run without talking to each other derive it alike from what they share:
the ranks (and groups) of a job resuming one checkpoint, a striped queue's stripes, a
run re-created after Redis lost it.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["RUN_ID_CHARS", "lost_run_id", "new_run_id", "resume_run_id", "stripe_run_id"]

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
