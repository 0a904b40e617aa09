"""A fixed pool keeps its workers: one killed is replaced (bounded), one that exits by
itself ends the pool."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from batchq.host.pool import REPLACE_EXIT_CODE, Replacements, keep_workers
from batchq.host.procs import Child, spawn, stop_group

SUICIDE = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def _starter(code: str, started: list[Child]) -> Callable[[], Child]:
    def start() -> Child:
        proc = spawn([sys.executable, "-c", code])
        started.append(proc)
        return proc

    return start


@pytest.fixture
def started() -> Iterator[list[Child]]:
    procs: list[Child] = []
    yield procs
    for proc in procs:
        stop_group(proc, timeout_s=5.0)


def test_killed_workers_are_replaced_until_too_many_die(started: list[Child]) -> None:
    bound = Replacements(max_deaths=3, window_s=600.0)
    code = keep_workers(
        _starter(SUICIDE, started), 1, threading.Event(), replacements=bound, poll_s=0.01
    )
    assert code == 9  # the last death, not replaced, is the pool's exit code
    assert len(started) == 4 and bound.replaced == 3 and bound.exhausted
    assert all(p.returncode == -9 for p in started)


def test_a_worker_that_exits_by_itself_is_not_replaced(started: list[Child]) -> None:
    code = keep_workers(_starter("raise SystemExit(3)", started), 2, threading.Event(), poll_s=0.01)
    assert code == 3 and len(started) == 2


def test_deaths_outside_the_window_are_forgotten() -> None:
    class Dead:
        pid, returncode = 1, -9

    bound = Replacements(max_deaths=1, window_s=10.0)
    assert bound.replace(Dead(), 0.0) and bound.replace(Dead(), 20.0)
    assert not bound.replace(Dead(), 21.0) and bound.exhausted


def test_a_worker_stopped_on_a_stuck_build_is_replaced_too(started: list[Child]) -> None:
    bound = Replacements(max_deaths=2, window_s=600.0)
    stuck = f"raise SystemExit({REPLACE_EXIT_CODE})"  # what serve exits on BuildTimeout
    code = keep_workers(_starter(stuck, started), 1, threading.Event(), replacements=bound)
    assert code == REPLACE_EXIT_CODE and len(started) == 3 and bound.replaced == 2
