"""Receiving frames stored by reference into buffers the trainer owns.

redis-py hands a reply over as an immutable ``bytes`` object, so an array over it can
only be writable after a copy. For frames stored by reference (the large ones), the
reader sends its pipelined ``GETDEL`` commands on the connection itself and reads each
bulk reply straight from the socket into a fresh, uninitialised numpy buffer of that
frame's size (``recv_into``): one buffer per frame, never pooled, so the arrays decoded
over it are writable without a copy and no later frame can write into them.

Only a plain socket of redis-py's own connection is read this way; any other connection
(fakeredis in unit tests, a parser holding unread bytes) takes redis-py's pipeline and
copies each reply once into a buffer of its own.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import redis

from batchq.protocol.scripts import execute_pipeline

__all__ = ["Reply", "getdel_into"]

_CHUNK = 64 * 1024  # what one recv takes when reading reply headers


Reply = memoryview | redis.ResponseError | None


def getdel_into(
    client: redis.Redis, keys: list[str], *, raise_on_error: bool = True
) -> list[Reply]:
    """GETDEL each key, each value received into a writable buffer of its own.

    Args:
        client: the reader's client.
        keys: the frame keys to fetch and delete.
        raise_on_error: raise the first error Redis answered (after reading every reply);
            False: return it in that key's place (a key of another type, WRONGTYPE).

    Returns:
        One writable byte memoryview per key (None where the key was gone, the error where
        Redis refused and ``raise_on_error`` is False).

    Raises:
        redis.ConnectionError, redis.TimeoutError: the connection failed (it is dropped,
            never handed back out of step with its replies).
        redis.ResponseError: Redis refused a command (after all replies were read).
    """
    pool = client.connection_pool
    conn: Any = pool.get_connection()
    try:
        sock = _plain_socket(conn)
        if sock is None:
            return _fallback(client, keys, raise_on_error)
        replies = _read_replies(conn, sock, keys)
        for reply in replies:
            if raise_on_error and isinstance(reply, redis.ResponseError):
                raise reply
        return replies
    finally:
        pool.release(conn)


def _plain_socket(conn: Any) -> socket.socket | None:
    """The connection's plain socket (connected now if it was not), or None where it
    is not one, or its parser holds unread bytes."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        conn.connect()
        sock = getattr(conn, "_sock", None)
    if not isinstance(sock, socket.socket) or _parser_holds_data(conn):
        return None
    return sock


def _read_replies(conn: Any, sock: socket.socket, keys: list[str]) -> list[Reply]:
    """Send the GETDELs and read one reply per key (a connection that failed is
    dropped, never handed back out of step with its replies)."""
    try:
        conn.send_packed_command(conn.pack_commands([("GETDEL", key) for key in keys]))
        reader = _BulkReader(sock)
        replies = [reader.bulk() for _ in keys]
    except (OSError, ValueError) as e:
        conn.disconnect()
        if isinstance(e, socket.timeout):
            raise redis.TimeoutError(f"reading a frame: {e}") from e
        raise redis.ConnectionError(f"reading a frame: {e}") from e
    except BaseException:
        conn.disconnect()
        raise
    if reader.leftover:
        conn.disconnect()  # cannot happen with one reply per command; stay safe
        raise redis.ConnectionError(f"{reader.leftover} unexpected bytes after the replies")
    return replies


def _parser_holds_data(conn: Any) -> bool:
    reader = getattr(getattr(conn, "_parser", None), "_reader", None)
    has_data = getattr(reader, "has_data", None)
    return bool(has_data()) if callable(has_data) else False


def _fallback(client: redis.Redis, keys: list[str], raise_on_error: bool) -> list[Reply]:
    replies = execute_pipeline(
        client,
        lambda pipe: [pipe.execute_command("GETDEL", k) for k in keys],
        raise_on_error=raise_on_error,
    )
    out: list[Reply] = []
    for value in replies:
        if value is None or isinstance(value, redis.ResponseError):
            out.append(value)
            continue
        buf = np.empty(len(value), dtype=np.uint8)
        buf[:] = np.frombuffer(value, dtype=np.uint8)
        out.append(memoryview(buf))  # type: ignore[arg-type]
    return out


class _BulkReader:
    """Reads bulk-string replies (RESP2 or RESP3), each payload straight into its own buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()  # bytes read past the last reply consumed

    @property
    def leftover(self) -> int:
        return len(self.buf)

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > _CHUNK:
                raise redis.ConnectionError("a reply header longer than 64 KiB")
            chunk = self.sock.recv(_CHUNK)
            if not chunk:
                raise redis.ConnectionError("Redis closed the connection")
            self.buf += chunk

    def bulk(self) -> memoryview | redis.ResponseError | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return redis.ResponseError(rest.decode("utf-8", "replace"))
        if kind == b"_":  # RESP3's null (redis-py 8 speaks RESP3 where the server does)
            return None
        if kind != b"$":
            raise redis.ConnectionError(f"unexpected reply {line[:64]!r} to GETDEL")
        size = int(rest)
        if size < 0:
            return None
        out = np.empty(size, dtype=np.uint8)
        view = memoryview(out)  # type: ignore[arg-type]
        have = min(size, len(self.buf))
        view[:have] = self.buf[:have]
        del self.buf[:have]
        while have < size:
            n = self.sock.recv_into(view[have:], size - have)
            if n == 0:
                raise redis.ConnectionError("Redis closed the connection mid-frame")
            have += n
        while len(self.buf) < 2:
            chunk = self.sock.recv(_CHUNK)
            if not chunk:
                raise redis.ConnectionError("Redis closed the connection")
            self.buf += chunk
        if self.buf[:2] != b"\r\n":
            raise redis.ConnectionError("a frame's reply does not end with CRLF")
        del self.buf[:2]
        return view
