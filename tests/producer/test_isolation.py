"""Isolation in one process (issue 42): a read tried in a forked child, and a
DatasetStream built isolated, which finds an example that aborts or hangs and builds the
same bytes as a stream where that example raises."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_pipelines import BrokenExamples, iterable_stream  # noqa: E402

from producer.errors import ExampleKilled  # noqa: E402
from producer.isolation import ChildReader, isolation_of  # noqa: E402
from producer.quarantine import LocalRecords  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch import DatasetStream  # noqa: E402

EXAMPLES, BATCH = 60, 6
ABORT, HANG, RAISE = 7, 31, 44


def reads(what: dict[int, Any]) -> ChildReader:
    """A ChildReader whose read of i calls ``what[i]`` (a plain read where absent)."""
    return ChildReader(lambda i: what.get(i, lambda: i)())


def test_reads_that_return_or_raise_in_the_child_pass_in_one_child() -> None:
    child = reads({2: lambda: 1 / 0})  # raises in-process too: not a crash
    try:
        for i in range(4):
            child.try_read(i, f"example {i}", 5.0)
        assert child.pid is not None  # one child for all of them
    finally:
        child.close()
    assert child.pid is None


def test_a_read_that_aborts_is_named_with_its_signal_and_the_next_read_forks_again() -> None:
    child = reads({7: os.abort, 8: lambda: os._exit(3)})
    try:
        child.try_read(6, "example 6", 5.0)
        first = child.pid
        with pytest.raises(
            ExampleKilled, match=r"^the producer died \(SIGABRT\) building example 7$"
        ):
            child.try_read(7, "example 7", 5.0)
        assert child.pid is None
        with pytest.raises(ExampleKilled, match=r"\(exit code 3\) building example 8$"):
            child.try_read(8, "example 8", 5.0)
        child.try_read(9, "example 9", 5.0)
        assert child.pid not in (None, first)
    finally:
        child.close()


def test_a_child_killed_between_reads_is_replaced_without_blaming_an_example() -> None:
    child = reads({})
    try:
        child.try_read(1, "example 1", 5.0)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        child.try_read(2, "example 2", 5.0)  # a new child reads it
    finally:
        child.close()


def test_a_read_that_never_returns_is_stopped_after_the_timeout() -> None:
    child = reads({9: lambda: threading.Event().wait()})
    with pytest.raises(ExampleKilled) as caught:
        child.try_read(9, "example 9", 0.2)
    assert str(caught.value) == (
        "example 9 never returned: no result after build_timeout_s=0.2 (read in a forked "
        "child, stopped)"
    )
    assert child.pid is None  # killed and reaped


def stream(abort: set[int], hang: set[int], bad: set[int], quarantine: bool) -> DatasetStream:
    s = DatasetStream(
        BrokenExamples(EXAMPLES, bad, abort=frozenset(abort), hang=frozenset(hang)),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        sources=("index", "aug"),
    )
    if quarantine:
        s.set_sample_errors("quarantine", 0.1)
    return s


def built(s: DatasetStream, epoch: int) -> list[tuple[bytes, ...]]:
    plan = ShardPlan(s)
    return [
        tuple(np.asarray(v).tobytes() for v in b)
        for k in range(plan.shards)
        for b in plan.iter_shard(epoch, k)
    ]


def test_an_isolated_build_quarantines_a_crash_as_the_same_bytes_as_an_error() -> None:
    served = stream({ABORT}, {HANG}, {RAISE}, quarantine=True)
    isolate = isolation_of(served)
    assert isolate is not None and isolate(True, 0.5) is True
    records = LocalRecords()
    assert served.sample_errors is not None
    served.sample_errors.bind(records, "p")
    reference = stream(set(), set(), {ABORT, HANG, RAISE}, quarantine=True)
    assert built(served, 1) == built(reference, 1)
    listed = {r["index"]: r for r in records.listing(10)}
    assert sorted(listed) == sorted([ABORT, HANG, RAISE])
    assert listed[ABORT]["error_type"] == "ExampleKilled"
    assert listed[ABORT]["message"] == f"the producer died (SIGABRT) building example {ABORT}"
    assert listed[HANG]["message"].startswith(f"example {HANG} never returned")
    assert listed[RAISE]["error_type"] == "ValueError"
    # Met again (another epoch), known: not read again, the same bytes without isolation.
    isolate(False)
    assert built(served, 2) == built(reference, 2)


def test_without_quarantine_an_isolated_build_raises_naming_the_example() -> None:
    served = stream({ABORT}, set(), set(), quarantine=False)
    isolate: Any = isolation_of(served)
    isolate(True, 5.0)
    with pytest.raises(ExampleKilled, match=rf"\(SIGABRT\) building example {ABORT}$"):
        built(served, 0)


def test_a_new_run_records_the_examples_known_bad_again() -> None:
    served = stream(set(), set(), {RAISE}, quarantine=True)
    errors = served.sample_errors
    assert errors is not None
    first = LocalRecords()
    errors.bind(first, "p")
    built(served, 0)
    assert first.count == 1
    second = LocalRecords()  # a resume's run: its records start afresh
    errors.bind(second, "p")
    built(served, 1)
    (record,) = second.listing(10)
    assert (
        record["index"] == RAISE and record["epoch"] == 1 and record["error_type"] == "ValueError"
    )


def test_examples_learnt_from_the_run_are_skipped_unread() -> None:
    served = stream({ABORT}, set(), set(), quarantine=True)  # not isolated: would abort
    errors = served.sample_errors
    assert errors is not None
    errors.learn(ABORT, ("ExampleKilled", "the producer died (SIGABRT)", ""))
    errors.learn(EXAMPLES + 5, ("ValueError", "out of range: ignored", ""))
    reference = stream(set(), set(), {ABORT}, quarantine=True)
    assert built(served, 0) == built(reference, 0)
    assert errors.known_bad == {ABORT}


def test_an_iterable_dataset_is_never_isolated() -> None:
    # No example to read alone (its root is the shards' scheme): its shard stays under
    # build_timeout_s's watch.
    assert isolation_of(iterable_stream()) is None
