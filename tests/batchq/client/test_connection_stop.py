"""batchq.client.connection's StopEvent: the stop flag a signal handler sets."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from waiting import read_until

from batchq.client.connection import StopEvent
from batchq.host.procs import spawn, stop_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_a_stop_event_starts_unset_and_a_wait_times_out_unset() -> None:
    stop = StopEvent()
    assert not stop.is_set()
    assert stop.wait(0.01) is False
    assert stop.wait(0) is False
    assert stop.wait(-1) is False


def test_set_wakes_every_thread_that_waits_and_stays_set() -> None:
    stop = StopEvent()
    woke: list[bool] = []
    waiting = [threading.Thread(target=lambda: woke.append(stop.wait(30.0))) for _ in range(3)]
    for thread in waiting:
        thread.start()
    stop.set()
    for thread in waiting:
        thread.join(timeout=30.0)
        assert not thread.is_alive()
    assert woke == [True, True, True]
    stop.set()  # again: nothing more to write
    assert stop.is_set() and stop.wait(0) and stop.wait(None)


def test_set_from_a_signal_handler_wakes_the_main_thread() -> None:
    stop = StopEvent()
    previous = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(30.0) is True
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_its_descriptors_close_with_it() -> None:
    stop = StopEvent()
    fds = (stop._read_fd, stop._write_fd)
    del stop
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


# The child waits in a loop (as a producer waits for room in the queue) while a handler
# sets the event it waits on; each time it is set, a fresh one replaces it. A
# threading.Event there deadlocks within a few hundred signals, about one run in three:
# the handler's set() waits for the lock that the interrupted wait() holds.
_HAMMERED = textwrap.dedent(
    """
    import signal, sys
    from batchq.client.connection import StopEvent
    stop = StopEvent()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    print("ready", flush=True)
    sets = 0
    while sets < int(sys.argv[1]):
        stop.wait(1e-5)
        if stop.is_set():
            sets += 1
            stop = StopEvent()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the parent still sends: exit whole
    print("done", flush=True)
    """
)


def test_a_waiter_hammered_by_signals_that_set_its_event_never_deadlocks() -> None:
    env = {**os.environ, "PYTHONPATH": REPO}
    child = spawn(
        [sys.executable, "-c", _HAMMERED, "2000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        read_until(child.stdout, b"ready\n")
        deadline = time.monotonic() + 90.0  # a bound for a hang, not a timing
        while child.poll() is None and time.monotonic() < deadline:
            os.kill(child.pid, signal.SIGUSR1)
        assert child.poll() == 0, "the child stopped taking signals: deadlocked"
        assert child.stdout.read() == b"done\n"
    finally:
        stop_group(child, timeout_s=5.0)


def test_a_forked_child_has_a_pipe_of_its_own() -> None:
    # The kernel's pipe is shared across a fork: a child's set() left a byte that made
    # every wait of the parent return at once, its flag unset (a supervisor at 100% CPU).
    stop, done = StopEvent(), StopEvent()
    done.set()  # set before the fork: set in the child too
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0 if done.wait(0) and not stop.is_set() else 1
        stop.set()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not stop.is_set()
    poller = select.poll()
    poller.register(stop._read_fd, select.POLLIN)
    assert poller.poll(0) == []  # nothing written to the parent's pipe
    assert stop.wait(0.01) is False


def test_a_wait_without_a_bound_in_practice_is_no_limit() -> None:
    stop = StopEvent()
    threading.Timer(0.01, stop.set).start()
    assert stop.wait(float("inf")) is True  # poll()'s milliseconds overflowed a C int
