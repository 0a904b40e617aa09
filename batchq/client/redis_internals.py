"""Everything batchq takes from redis-py's internals, in one place.

Two measured costs are only avoidable below redis-py's public API (docs/design.md,
"Scripts" and "Client settings that matter"):

* **The command packer.** redis-py's hiredis packer copies every value; its pure-Python
  one (``redis.connection.PythonRespSerializer``, not exported) sends large values as
  separate buffers. :func:`pieces_packer` subclasses it to send a frame's
  :class:`~batchq.wire.frame.Pieces` (header, then each array's own memory) as one bulk
  string without a copy, and packs small commands with hiredis.
* **Replies into buffers of their own.** redis-py hands a reply over as an immutable
  ``bytes`` object, so an array over it is writable only after a copy.
  :func:`read_bulk_into` reads one bulk-string reply straight from the connection's
  socket (``_sock``) into a fresh, uninitialised numpy buffer of its size, never reading
  past that reply (the header line is peeked first), so redis-py's parser (``_parser``)
  goes on with the next reply as usual. Where the socket is not a plain one (TLS,
  fakeredis) or the parser already holds unread bytes, the reply is read by redis-py
  and copied once.
* **The pool's checks.** ``get_connection``/``release`` cost more client CPU than the
  round trip they wrap (a ``select`` for stale data, a pid check, observability counters
  and events: a PING 130-150 us through the pool, 65-80 us without, on the 2-core
  machine). :class:`HeldPool` lets the one thread that owns a client's hot path take its
  last connection straight from the pool's idle list and put it back, under the pool's
  own lock (``_lock``, ``_available_connections``, ``_in_use_connections``). A thread
  that owns a client (the producer's serving thread, the trainer's reader) :func:`hold` s
  it; :func:`batchq.protocol.calls.round_trip` then :func:`borrow` s that thread's
  connection and gives it back (:func:`give_back`). The state lives in the client's own
  pool (every client of :func:`batchq.client.connection.make_client` has a
  :class:`HeldPool`): there is no registry, and a client whose pool is of another kind
  goes through its pool as usual. What the pool's checks gave is kept by the one caller,
  ``round_trip``: a connection that failed or was interrupted half-way is disconnected
  before anything reads it again (it reconnects, authenticated, at its next use), so no
  one is handed a connection that is out of step.

Nothing else in batchq touches a private name of redis-py. :data:`TESTED_REDIS_PY` is
the range pyproject pins; :func:`check_internals` says what is missing on another
version, and tests/batchq/client/test_redis_internals.py fails loudly when it does.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
from redis.connection import Encoder, PythonRespSerializer  # type: ignore[attr-defined]

from batchq.wire.frame import Pieces

__all__ = [
    "CONNECTION_PARTS",
    "POOL_PARTS",
    "TESTED_REDIS_PY",
    "BulkReply",
    "HeldPool",
    "borrow",
    "check_internals",
    "give_back",
    "hold",
    "pieces_packer",
    "read_bulk_into",
    "release_hold",
]

# The redis-py releases these internals were checked on (pyproject pins the same).
TESTED_REDIS_PY = ((8, 2), (8, 3))  # [low, high): 8.2.x
# The ConnectionPool attributes HeldPool moves connections through.
POOL_PARTS = ("_lock", "_available_connections", "_in_use_connections")
# The Connection attributes read_bulk_into reads: its socket, and its parser (whose
# reader must hold no unread bytes when the socket is read directly).
CONNECTION_PARTS = ("_sock", "_parser")
_BUFFER_CUTOFF = 6000  # redis-py's own cutoff: larger values travel as separate buffers


def check_internals() -> list[str]:
    """What this module needs of redis-py and the installed version lacks (empty: all)."""
    missing = [f"ConnectionPool.{part}" for part in POOL_PARTS if not _pool_has(part)]
    conn = redis.Connection()  # type: ignore[no-untyped-call]
    missing += [f"Connection.{part}" for part in CONNECTION_PARTS if not hasattr(conn, part)]
    if not callable(getattr(PythonRespSerializer, "pack", None)):
        missing.append("PythonRespSerializer.pack")
    return missing


def _pool_has(part: str) -> bool:
    pool = redis.ConnectionPool()
    try:
        return hasattr(pool, part)
    finally:
        pool.disconnect()


class HeldPool(redis.ConnectionPool):
    """redis-py's ConnectionPool, plus a connection the owner thread takes without checks.

    The thread that owns a client's hot path calls :meth:`hold`; its round trips then
    :meth:`borrow` the connection it used last and :meth:`give_back` it. Between round
    trips that connection is an idle one of the pool like any other, so the thread's other
    commands (redis-py's own) reuse it: the client keeps one connection. Where another
    thread took it meanwhile, or in a forked child, the pool is used as usual. The state
    is this pool's own: no registry outside it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner: tuple[int, int] | None = None  # (thread ident, pid) of the holder
        self._owner_conn: Any = None  # the owner's last connection

    def hold(self) -> None:
        """The calling thread owns this pool's round trips from now on."""
        self._owner = (threading.get_ident(), _pid)
        self._owner_conn = None

    def release_hold(self) -> None:
        """The owner stops (its close): round trips go through the pool again."""
        self._owner = None
        self._owner_conn = None

    def held_by_caller(self) -> bool:
        """Whether the calling thread, in the process that held it, is the owner."""
        owner = self._owner
        return owner is not None and owner == (threading.get_ident(), _pid)

    def borrow(self) -> tuple[Any, bool]:
        """A connection for one round trip: ``(conn, direct)``; end it with give_back."""
        if not self.held_by_caller():
            return self.get_connection(), False
        conn = self._owner_conn
        if conn is not None:
            with self._lock:
                if conn in self._available_connections:
                    self._available_connections.remove(conn)
                    self._in_use_connections.add(conn)
                    return conn, True
            # Another thread has it (or the pool dropped it): take one the usual way.
        # Lent the usual way this time (and given back so): the next one goes directly.
        self._owner_conn = self.get_connection()
        return self._owner_conn, False

    def give_back(self, conn: Any, direct: bool) -> None:
        """End a round trip started with :meth:`borrow`."""
        if not direct:
            self.release(conn)
            return
        with self._lock:
            if conn in self._in_use_connections:
                self._in_use_connections.remove(conn)
                self._available_connections.append(conn)
                return
        # The pool forgot it (reset): it is not the pool's to take back.
        conn.disconnect()


def hold(client: redis.Redis) -> None:
    """The calling thread owns ``client``'s round trips from now on."""
    pool = client.connection_pool
    if isinstance(pool, HeldPool):
        pool.hold()


def release_hold(client: redis.Redis) -> None:
    """The owner stops (its close): round trips go through the pool again (idempotent)."""
    pool = client.connection_pool
    if isinstance(pool, HeldPool):
        pool.release_hold()


def borrow(client: redis.Redis) -> tuple[Any, bool]:
    """A connection of ``client`` for one round trip: ``(conn, direct)``, the owner
    thread's own where it holds the client (:meth:`HeldPool.borrow`), else the pool's;
    end the round trip with :func:`give_back`."""
    pool: Any = client.connection_pool
    if isinstance(pool, HeldPool):  # also a Sentinel master's (batchq.client.sentinel)
        return pool.borrow()
    return pool.get_connection(), False


def give_back(client: redis.Redis, conn: Any, direct: bool) -> None:
    """End a round trip started with :func:`borrow`."""
    pool: Any = client.connection_pool
    if isinstance(pool, HeldPool):
        pool.give_back(conn, direct)
    else:
        pool.release(conn)


# The process's pid, kept current across forks: os.getpid() is a system call per round
# trip otherwise. A fact of the process, not state of batchq's.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


_pack_command: Callable[..., bytes] | None
try:
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - hiredis comes with redis[hiredis]
    _pack_command = None


def _all_small(args: tuple[Any, ...]) -> bool:
    # A plain loop: this runs for every command (a generator cost as much as the pack).
    for arg in args:
        kind = type(arg)
        if kind is str or kind is bytes:
            if len(arg) > _BUFFER_CUTOFF:
                return False
        elif kind is not int and kind is not float:  # not bool: redis-py refuses it
            return False
    return True


class _PiecesPacker(PythonRespSerializer):
    """redis-py's pure-Python packer, plus :class:`Pieces` arguments."""

    def pack(self, *args: Any) -> list[Any]:
        if _pack_command is not None and args and _all_small(args):
            # Small commands (the scripts' calls, shared-memory descriptors): hiredis
            # packs them in a tenth of the time (3 vs 24 us for a push); it copies every
            # value, which only matters for the large ones.
            # As redis-py: a command name with a space ("SCRIPT LOAD") is two words.
            head = tuple(args[0].split()) if isinstance(args[0], str) else args[:1]
            return [_pack_command((*head, *args[1:]))]
        if not any(isinstance(a, Pieces) for a in args):
            return list(super().pack(*args))  # type: ignore[no-untyped-call]
        # Pack around each Pieces argument: the other arguments go through redis-py.
        output: list[Any] = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            if isinstance(arg, Pieces):
                output.append(f"${arg.nbytes}\r\n".encode())
                output.extend(arg.buffers)
                output.append(b"\r\n")
            else:
                data = self.encode(arg)
                output.append(b"$%d\r\n" % len(data))
                output.append(data)
                output.append(b"\r\n")
        return output


def pieces_packer() -> Any:
    """The command packer batchq's clients use (see the module's docstring)."""
    encoder = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
    return _PiecesPacker(_BUFFER_CUTOFF, encoder.encode)


#: One bulk reply read by :func:`read_bulk_into`: the value in a writable buffer of its
#: own, None for a missing key, or the error Redis answered.
BulkReply = memoryview | redis.ResponseError | None

_PEEK_BYTES = 64  # a bulk reply's header line ('$<size>\r\n') fits in this
_LINE_CAP_BYTES = 64 * 1024  # an error reply's text longer than this: out of step


def read_bulk_into(conn: Any) -> BulkReply:
    """Read one bulk-string reply of ``conn`` into a writable buffer of its own.

    Raises:
        redis.ConnectionError, redis.TimeoutError: the connection failed mid-reply (the
            caller disconnects it: it is out of step).
    """
    sock = getattr(conn, "_sock", None)
    reader = getattr(getattr(conn, "_parser", None), "_reader", None)
    has_data = getattr(reader, "has_data", None)
    if type(sock) is not socket.socket or (callable(has_data) and has_data()):
        return _copied(conn)
    try:
        return _read_plain(sock)
    except TimeoutError as e:
        raise redis.TimeoutError(f"reading a reply: {e}") from e
    except OSError as e:
        raise redis.ConnectionError(f"reading a reply: {e}") from e


def _copied(conn: Any) -> BulkReply:
    """The reply through redis-py's parser, copied once into a buffer of its own."""
    try:
        value = conn.read_response()
    except redis.ResponseError as e:
        return e
    if value is None:
        return None
    if not isinstance(value, bytes | bytearray | memoryview):
        raise redis.ConnectionError(f"expected a bulk string, got {type(value).__name__}")
    out = np.empty(len(value), dtype=np.uint8)
    out[:] = np.frombuffer(value, dtype=np.uint8)
    return memoryview(out)  # type: ignore[arg-type]


def _read_plain(sock: socket.socket) -> BulkReply:
    """Read exactly one reply from a plain socket: never a byte of the next one."""
    line = _line(sock)
    kind, rest = line[:1], line[1:]
    if kind == b"-":
        return redis.ResponseError(rest.decode("utf-8", "replace"))
    if kind == b"_":  # RESP3's null (redis-py 8 speaks RESP3 where the server does)
        return None
    if kind != b"$":
        raise redis.ConnectionError(f"unexpected reply {line[:64]!r}: not a bulk string")
    size = int(rest)
    if size < 0:
        return None
    out = np.empty(size, dtype=np.uint8)
    view = memoryview(out)  # type: ignore[arg-type]
    _recv_exactly(sock, view)
    if _recv_bytes(sock, 2) != b"\r\n":
        raise redis.ConnectionError("a bulk reply does not end with CRLF")
    return view


def _line(sock: socket.socket) -> bytes:
    """A reply's header line without its CRLF; only the line is taken from the socket."""
    want, flags = _PEEK_BYTES, socket.MSG_PEEK
    while True:
        peeked = sock.recv(want, flags)
        if not peeked:
            raise redis.ConnectionError("Redis closed the connection")
        end = peeked.find(b"\r\n")
        if end >= 0:
            return _recv_bytes(sock, end + 2)[:end]
        if len(peeked) >= _LINE_CAP_BYTES:
            raise redis.ConnectionError(f"a reply line longer than {_LINE_CAP_BYTES} bytes")
        # The line is longer than what was looked at (an error's text), or only part of
        # it has arrived and the rest must come: look again at one byte more than is
        # there (waiting for it), or at twice as much, still taking none.
        if len(peeked) < want:
            want, flags = len(peeked) + 1, socket.MSG_PEEK | socket.MSG_WAITALL
        else:
            want, flags = 2 * want, socket.MSG_PEEK


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exactly(sock, memoryview(buf))
    return bytes(buf)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    have, size = 0, len(view)
    while have < size:
        n = sock.recv_into(view[have:], size - have)
        if n == 0:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        have += n
