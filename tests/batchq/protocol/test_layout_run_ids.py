"""batchq.protocol.layout: a run's id, fresh or derived alike by every process."""

from __future__ import annotations

import hashlib
import re

from batchq.protocol.layout import (
    RUN_ID_CHARS,
    lost_run_id,
    new_run_id,
    resume_run_id,
    stripe_run_id,
)

HEX = re.compile(rf"[0-9a-f]{{{RUN_ID_CHARS}}}")


def test_fresh_ids_are_random_and_of_the_documented_form() -> None:
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(HEX.fullmatch(i) for i in ids)


def test_derived_ids_are_the_same_for_the_same_inputs_and_differ_otherwise() -> None:
    assert resume_run_id("r1", 2) == resume_run_id("r1", 2)
    derived = {
        resume_run_id("r1", 2), resume_run_id("r1", 4), resume_run_id("r2", 2),
        stripe_run_id("r1", 1), stripe_run_id("r1", 2), lost_run_id("r1"),
    }  # fmt: skip
    assert len(derived) == 6
    assert all(HEX.fullmatch(i) for i in derived)


def test_the_ids_checkpoints_resume_into_do_not_change() -> None:
    # Ranks of one job may run different versions while a job restarts: the derivation
    # is pinned (sha1 of 'resume:<run>:<world>', its first 16 hex digits).
    pinned = hashlib.sha1(b"resume:abc:2").hexdigest()[:16]
    assert resume_run_id("abc", 2) == pinned
