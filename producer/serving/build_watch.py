"""``build_timeout_s``: a batch whose build takes longer is given up, and its producer
stops.

With ``build_timeout_s`` set, a producer builds each batch on a worker thread of its own
and waits for it at most that long. A build past it raises :class:`BuildTimeout` in the
serving thread, naming the shard and, where the stream's root says what it is reading
(``reading``: a :class:`producer.torch.dataset.DatasetStream` names the example), the
example: the pusher counts it as a failed attempt (fail.lua: the shard goes back to the
work list, or after ``max_attempts`` the trainer gets ``ProducerFailed`` with that
message), and the producer then stops serving and raises it (``batchq serve`` exits
non-zero, a ``--workers`` pool starts another). It cannot go on: the build still runs
(a thread cannot be stopped) and would draw from the global generators and move the
stream's state under the next shard's build. The worker is a daemon thread, so a process
whose build never returns still exits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from producer.errors import BuildTimeout
from producer.serving.sharding import find_root

__all__ = ["BuildWatch", "reading_of"]

T = TypeVar("T")


class BuildWatch:
    """Runs builds on a daemon worker thread, each for at most ``timeout_s``.

    Args:
        timeout_s: the longest a build may take.
        reading: ``() -> str``: what the stream is reading now ('' when it cannot tell),
            for the error's message.
    """

    def __init__(self, timeout_s: float, reading: Callable[[], str]) -> None:
        self.timeout_s = timeout_s
        self.reading = reading
        self.hung: BuildTimeout | None = None  # set once a build ran past timeout_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def call(self, build: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
        """``build()`` on the worker thread: its result, or what it raised.

        Args:
            timeout_s: this build's bound; None: :attr:`timeout_s`.

        Raises:
            BuildTimeout: it took more than the bound (``what``: the batch, named in the
                message); the watch is then :attr:`hung` and runs nothing more.
        """
        bound_s = self.timeout_s if timeout_s is None else timeout_s
        if self.hung is not None:
            raise self.hung
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="batchq-build", daemon=True)
            self._thread.start()
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs.put((build, done))
        try:
            ok, value = done.get(timeout=bound_s)
        except queue.Empty:
            reading = self.reading()
            self.hung = BuildTimeout(
                f"{what}: no batch after build_timeout_s={self.timeout_s}"
                + (f" x {bound_s / self.timeout_s:g}" if bound_s != self.timeout_s else "")
                + (f" (reading {reading})" if reading else "")
            )
            raise self.hung from None
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def _work(self) -> None:
        while True:
            build, done = self._jobs.get()
            try:
                done.put((True, build()))
            except BaseException as e:  # handed to the serving thread, which raises it
                done.put((False, e))


def reading_of(stream: Any) -> Callable[[], str]:
    """``() -> str``: what the root of ``stream`` reads now, where it says (its
    ``reading`` attribute), else ''."""
    root = find_root(stream)
    return lambda: str(getattr(root, "reading", "") or "")
