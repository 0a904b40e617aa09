"""batchq.errors: one root, groups to catch a kind of trouble at once."""

from __future__ import annotations

import inspect

import batchq
from batchq import errors


def test_every_error_is_a_batchq_error_and_exported() -> None:
    classes = [
        c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__
    ]
    assert all(issubclass(c, errors.BatchQueueError) for c in classes)
    assert {c.__name__ for c in classes} <= set(batchq.__all__)
    assert batchq.__all__ == sorted(batchq.__all__)


def test_the_groups() -> None:
    for member in (errors.RunFinished, errors.RunChanged, errors.StateLost, errors.TrainerConflict):
        assert issubclass(member, errors.RunEnded)
    for member in (errors.RedisConfigError, errors.WorldSizeMismatch, errors.StepMismatch):
        assert issubclass(member, errors.ConfigError) and issubclass(member, ValueError)
    assert issubclass(errors.RankLost, TimeoutError)
    assert issubclass(errors.AuthFailed, PermissionError)


def test_world_size_mismatch_names_both_sizes() -> None:
    e = errors.WorldSizeMismatch("q", 4, 2)
    assert (e.expected, e.got) == (4, 2)
    assert "world_size 2" in str(e) and "world_size 4" in str(e)
