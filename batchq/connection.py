"""Where to connect, and Redis clients tuned for moving MB-sized values.

Where both sides connect, first match wins: an explicit ``url``; an explicit
``host``/``port``; the environment's ``BATCHQ_URL``; ``redis://localhost:6379/0``.

The clients made here differ from redis-py's defaults in three ways, each measured:

* The pure-Python command packer is used instead of hiredis' one: hiredis' packer copies
  every value into one new string, about a third of the speed for 1 MiB values, while
  the Python packer sends large values as separate buffers without copying.
* Automatic retries are off (redis-py 8 retries a failed command up to 10 times): on the
  hot path a retried push or pop could apply twice, so batchq handles errors itself.
* glibc's malloc returns multi-MB blocks to the OS after each command and takes them back
  on the next; :func:`tune_malloc` raises those thresholds once per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from batchq.errors import ConfigError, ConnectionLost

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT_S",
    "DEFAULT_URL",
    "ENV_URL",
    "Pieces",
    "describe_url",
    "make_client",
    "redis_errors",
    "resolve_url",
    "tune_malloc",
]

log = logging.getLogger(__name__)

ENV_URL = "BATCHQ_URL"
DEFAULT_URL = "redis://localhost:6379/0"
# Blocking commands (BLPOP/BRPOP) always use timeouts well below this.
DEFAULT_SOCKET_TIMEOUT_S = 10.0
_BUFFER_CUTOFF = 6000  # redis-py's own cutoff: larger values travel as separate buffers

T = TypeVar("T")

redis_errors: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionResetError,
    BrokenPipeError,
)


def resolve_url(url: str | None = None, host: str | None = None, port: int | None = None) -> str:
    """Pick the Redis URL to use: explicit url, explicit host/port, BATCHQ_URL, localhost.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.
        host: a host name; with or without ``port``.
        port: a TCP port; with or without ``host``.

    Returns:
        The URL to connect to.

    Raises:
        ConfigError: the URL's scheme is not one Redis understands, or the port is not a
            valid TCP port.
    """
    if url:
        chosen = url
    elif host is not None or port is not None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"port {port!r} is not valid: expected an integer in 1..65535")
        chosen = f"redis://{host or 'localhost'}:{port or 6379}/0"
    else:
        chosen = os.environ.get(ENV_URL) or DEFAULT_URL
    scheme = urlsplit(chosen).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"Redis URL {describe_url(chosen)!r} is not valid: expected redis://, rediss:// "
            "or unix://"
        )
    return chosen


def describe_url(url: str) -> str:
    """The URL with any password masked, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


class Pieces:
    """One Redis value sent as several buffers, back to back, without joining them.

    A command argument of this type is written as one bulk string (its total length,
    then each buffer as it is): a frame's header and its arrays' own memory go to the
    socket without being copied into one buffer first.

    Args:
        buffers: the value's parts, in order (bytes, or byte-format memoryviews).
        nbytes: their total length.
    """

    def __init__(self, buffers: list[bytes | memoryview], nbytes: int) -> None:
        self.buffers = buffers
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(bytes(b) for b in self.buffers)

    def __repr__(self) -> str:
        return f"Pieces({len(self.buffers)} buffers, {self.nbytes} bytes)"


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
            return list(super().pack(*args))
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


def make_client(url: str, *, socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S) -> redis.Redis:
    """A redis-py client for batchq's hot paths: no automatic retry, no copying packer.

    Args:
        url: where to connect (see :func:`resolve_url`).
        socket_timeout_s: the socket timeout; blocking commands must use less.

    Returns:
        A client returning bytes (decode_responses off).
    """
    encoder = Encoder("utf-8", "strict", False)
    pool = redis.ConnectionPool.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 5.0),
        retry=Retry(NoBackoff(), 0),
        command_packer=_PiecesPacker(_BUFFER_CUTOFF, encoder.encode),
        health_check_interval=0,
    )
    return redis.Redis(connection_pool=pool)


def call(fn: Callable[[], T], what: str) -> T:
    """Run one Redis interaction, converting redis-py's connection errors.

    Args:
        fn: the interaction.
        what: what it does, for the error message.

    Raises:
        ConnectionLost: the connection failed or timed out.
    """
    try:
        return fn()
    except redis_errors as e:
        raise ConnectionLost(f"Redis connection lost while {what}: {e}") from e


_tuned = False


def tune_malloc() -> None:
    """Keep glibc from returning multi-MB blocks to the OS after every command.

    Measured on 2 cores: moving 1.5-5 MB values, the mmap/munmap and page faults of each
    block cost about as much as the copy itself. Raising M_MMAP_THRESHOLD and
    M_TRIM_THRESHOLD keeps those blocks in the heap for reuse. A no-op on other C
    libraries and after the first call.
    """
    global _tuned
    if _tuned or not sys.platform.startswith("linux"):
        return
    _tuned = True
    try:
        libc: Any = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 * 1024 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024 * 1024)
    log.debug("malloc thresholds raised for large values")
