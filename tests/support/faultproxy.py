"""A loopback TCP proxy in front of the test redis-server that drops and stalls connections.

Fault injection for the suite: every connection through the proxy is forwarded to the
real server, until a rule says otherwise:

* :meth:`FaultProxy.drop_on` closes the client's connection when a command it sends
  contains a pattern: before forwarding it (the command never ran) or after (it ran and
  its reply is lost), a given number of times;
* :meth:`FaultProxy.drop_all` closes every connection now;
* :meth:`FaultProxy.stall` holds every byte, both ways, until :meth:`resume`.

Threads only, bounded: each socket has a timeout, and :meth:`close` stops everything.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
from dataclasses import dataclass


@dataclass
class _Rule:
    pattern: bytes
    times: int
    after: bool


class FaultProxy:
    """Forward 127.0.0.1:<port> to ``target_port``, with faults on demand.

    Args:
        target_port: the real server's port on 127.0.0.1.
        seed: seeds :meth:`drop_random` (bounded, reproducible runs).
    """

    def __init__(self, target_port: int, seed: int = 0) -> None:
        self.target_port = target_port
        self.random = random.Random(seed)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._rules: list[_Rule] = []
        self._running = threading.Event()
        self._running.set()
        self._flowing = threading.Event()
        self._flowing.set()
        self.dropped = 0  # connections closed by a rule or drop_all
        self.matched: list[bytes] = []  # the patterns that fired, in order
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults ------------------------------------------------------------------------

    def drop_on(self, pattern: bytes, *, times: int = 1, after: bool = False) -> None:
        """Close the connection that sends ``pattern`` (the next ``times`` times).

        Args:
            after: forward the command first (it runs; its reply is lost).
        """
        with self._lock:
            self._rules.append(_Rule(pattern, times, after))

    def pending(self) -> int:
        """How many rule firings are still armed."""
        with self._lock:
            return sum(r.times for r in self._rules)

    def drop_all(self) -> int:
        """Close every open connection now; returns how many."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            _close(a)
            _close(b)
        self.dropped += len(pairs)
        return len(pairs)

    def stall(self) -> None:
        """Hold all traffic (both ways) until :meth:`resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        """Let traffic flow again."""
        self._flowing.set()

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        self._running.clear()
        self._flowing.set()
        self.drop_all()
        _close(self._listener)
        for t in self._threads:
            t.join(timeout=2)

    # -- forwarding --------------------------------------------------------------------

    def _accept(self) -> None:
        while self._running.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._pairs.append((client, server))
            t = threading.Thread(target=self._pump, args=(client, server), daemon=True)
            t.start()
            self._threads.append(t)

    def _match(self, data: bytes) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.times > 0 and rule.pattern in data:
                    rule.times -= 1
                    self.matched.append(rule.pattern)
                    return rule
        return None

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        try:
            while self._running.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.2)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    self._flowing.wait(timeout=30)
                    rule = self._match(data) if sock is client else None
                    if rule is not None and not rule.after:
                        self.dropped += 1
                        return
                    peer[sock].sendall(data)
                    if rule is not None:
                        self.dropped += 1
                        return
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                if (client, server) in self._pairs:
                    self._pairs.remove((client, server))
            _close(client)
            _close(server)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
