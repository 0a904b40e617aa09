"""Every call of the Lua scripts, built in one place (:func:`build_call`), and the one path
by which batchq's commands leave (:func:`round_trip`: the scripts' calls, the hot paths'
pipelines, the cold paths' pipelines built with redis-py's methods through
:func:`execute_pipeline`, and frames received into buffers of their own).

The scripts, their headers and shas are :mod:`batchq.protocol.script_files` (re-exported
here). :func:`build_call` puts a wrapper's named keys and arguments in the order of the
script's header, so no Python code spells a position, and a wrapper that names a key or
argument the script does not declare fails at once.

Each script is called with EVALSHA; on NOSCRIPT (a new or restarted server) it is loaded
and the call is retried once. Scripts are never wrapped in redis-py ``Script`` objects
inside pipelines: those send SCRIPT EXISTS on every execute. Every key a script touches
is passed in KEYS (Redis Cluster needs that), and all of them carry the queue's hash tag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import redis
from redis.exceptions import NoScriptError

from batchq.client.connection import convert_error
from batchq.client.redirects import REDIRECTS, follow_redirects
from batchq.client.redis_internals import borrow, give_back
from batchq.errors import ProtocolError
from batchq.protocol.script_files import SCRIPTS, Arg, Header, Script, load_all, parse_header
from batchq.wire.frame import Pieces

__all__ = [
    "SCRIPTS",
    "Arg",
    "Call",
    "Command",
    "CountReply",
    "Header",
    "Reader",
    "Script",
    "StatusReply",
    "build_call",
    "decode_reply",
    "execute_pipeline",
    "load_all",
    "parse_header",
    "reply_int",
    "round_trip",
]

Command = tuple[Arg | Pieces, ...]  # a command's name and arguments, as sent
#: Reads one reply from a connection (raising redis.ResponseError for an error reply);
#: None in :func:`round_trip`'s ``readers``: redis-py's raw ``read_response``.
Reader = Callable[[Any], Any]
R = TypeVar("R")


def decode_reply(reply: Any) -> list[Any]:
    """Decode a script's reply: bytes become str, nested tables stay lists of bytes.

    The elements of a nested list (popped frames) are left as bytes: they are data.
    """
    out: list[Any] = []
    for item in reply:
        if isinstance(item, bytes):
            out.append(item.decode("utf-8", "replace"))
        else:
            out.append(item)
    return out


def reply_int(values: list[Any], i: int, default: int = 0) -> int:
    """Element ``i`` of a decoded reply as an int (``default`` where the reply is shorter)."""
    return int(values[i]) if len(values) > i else default


class StatusReply(NamedTuple):
    """A reply that is only a status (handback, release/refresh of a claim)."""

    status: str

    @classmethod
    def parse(cls, raw: Any) -> StatusReply:
        """From ``{status, ...}``."""
        return cls(decode_reply(raw)[0])


class CountReply(NamedTuple):
    """reap.lua: ``{'OK', producers reaped, shards returned}``; handback.lua (a failed
    attempt): ``{'RETRY'|'GIVE_UP', attempts}``; resume.lua ``{'OK', run}`` / ``{'STEP',
    step}`` (``text``); or a status."""

    status: str
    first: int = 0
    second: int = 0
    text: str = ""

    @classmethod
    def parse(cls, raw: Any) -> CountReply:
        """From the raw reply."""
        r = decode_reply(raw)
        first = int(r[1]) if len(r) > 1 and str(r[1]).lstrip("-").isdigit() else 0
        return cls(r[0], first, reply_int(r, 2), str(r[1]) if len(r) > 1 else "")


@dataclass(frozen=True)
class Call(Generic[R]):
    """One call of a script, built by :func:`build_call`: run it, or queue it in a
    pipeline and parse its reply from the pipeline's replies."""

    script: Script
    keys: list[str]
    args: list[Arg]
    parse: Callable[[Any], R]

    def run(self, client: redis.Redis) -> R:
        """Run the script and parse its reply (one :func:`round_trip`)."""
        return self.parse(round_trip(client, [self.command()], f"running {self.script.name}")[0])

    def command(self) -> Command:
        """The call as one EVALSHA command, for :func:`round_trip`."""
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def queue(self, pipe: Any) -> None:
        """Add the call to a pipeline; parse its reply with :attr:`parse`."""
        self.script.queue(pipe, self.keys, self.args)


def _ordered(
    name: str, what: str, declared: tuple[str, ...], given: Mapping[str, Any]
) -> list[Any]:
    # On every push: a lookup per name and a length check (same length, every declared
    # name present: the same names), no sets built.
    try:
        values = [given[n] for n in declared]
    except KeyError:
        values = []
    if len(values) != len(declared) or len(given) != len(declared):
        missing, extra = sorted(set(declared) - set(given)), sorted(set(given) - set(declared))
        raise ProtocolError(f"{name}.lua declares {what} {list(declared)}; the call misses "
                            f"{missing} and names {extra}")  # fmt: skip
    # Only a trailing key may be left out (push's frame_key: inline frames have none).
    while values and values[-1] is None:
        values.pop()
    if None in values:
        raise ProtocolError(f"{name}.lua: only trailing {what} may be None: {dict(given)}")
    return values


def build_call(
    name: str,
    parse: Callable[[Any], R],
    keys: Mapping[str, str | None],
    args: Mapping[str, Arg],
    *,
    more_keys: Sequence[str] = (),
    more_args: Sequence[Arg] = (),
) -> Call[R]:
    """The one place a script's KEYS and ARGV are put in order.

    Args:
        name: the script.
        parse: turns its raw reply into a typed one (written beside the script's
            wrapper).
        keys: every KEYS local of the header by name (without ``_key``); a trailing one
            may be None (left out).
        args: every ARGV local of the header by name.
        more_keys: the KEYS tail, for a script whose header declares one.
        more_args: the ARGV tail, likewise.

    Raises:
        ProtocolError: the names differ from the script's header, or a tail is given to
            a script that declares none.
    """
    script = SCRIPTS[name]
    header = script.header
    if (more_keys and not header.keys_tail) or (more_args and not header.args_tail):
        raise ProtocolError(f"{name}.lua declares no KEYS/ARGV tail")
    ordered_keys = _ordered(name, "KEYS", header.keys, keys)
    ordered_args = _ordered(name, "ARGV", header.args, args)
    if more_keys and len(ordered_keys) != len(header.keys):
        raise ProtocolError(f"{name}.lua: a KEYS tail needs every named key")
    return Call(script, [*ordered_keys, *more_keys], [*ordered_args, *more_args], parse)


def execute_pipeline(client: redis.Redis, build: Any, *, raise_on_error: bool = True) -> list[Any]:
    """Run the commands ``build(pipe)`` adds to a redis-py pipeline, through
    :func:`round_trip`: one write, each reply parsed as redis-py's own method parses it.

    The pipeline only records (``build`` uses redis-py's command methods, and
    :meth:`Script.queue` for the scripts); nothing is sent by it. On NOSCRIPT the
    scripts are loaded and the refused commands sent again once (:func:`round_trip`).

    Args:
        client: the client.
        build: a function that adds the commands to a fresh pipeline.
        raise_on_error: False returns a command's error (WRONGTYPE...) in its place.

    Returns:
        The replies, in order.

    Raises:
        ConnectionLost: the connection failed.
        redis.ResponseError: the first error reply, with ``raise_on_error``.
    """
    pipe = client.pipeline(transaction=False)
    build(pipe)
    stack = list(pipe.command_stack)
    pipe.reset()
    if not stack:
        return []
    readers = [partial(_parsed, client, args[0], options) for args, options in stack]
    replies = round_trip(
        client, [args for args, _ in stack], "running a pipeline", readers=readers,
        keep_errors=True,
    )  # fmt: skip
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
    return replies


def _parsed(client: redis.Redis, name: Any, options: dict[str, Any], conn: Any) -> Any:
    """One reply of a recorded pipeline, parsed as redis-py parses its own (callbacks)."""
    return client.parse_response(conn, name, **dict(options))  # type: ignore[no-untyped-call]


def round_trip(
    client: redis.Redis,
    commands: Sequence[Command],
    what: str,
    between: Callable[[], None] | None = None,
    *,
    keep_errors: bool = False,
    readers: Sequence[Reader | None] | None = None,
) -> list[Any]:
    """Send ``commands`` in one write and read their replies: the one path by which
    batchq's commands leave.

    Every push and every pop of a batch is one of these. redis-py's ``Pipeline`` costs
    about as much CPU again as the commands it sends (a pipeline object, its retry
    wrapper, response callbacks, a reset: ~60 us a round trip on this project's 2-core
    machine, where a PING costs 80 us); this writes the packed commands and reads each
    reply from one connection. Replies are raw (no callbacks): scripts have none,
    and the few other commands sent this way are read as Redis replies them.

    An error reply is raised after every reply has been read, so the connection stays in
    step; a connection that failed half-way is closed before anything reads it again.
    On NOSCRIPT (a new or restarted server) every script is loaded and the commands it
    refused (they did not run) sent again once, alone: the others ran, and a push sent
    twice would list its frame twice.
    On a Redis Cluster, the commands a node refused with MOVED, ASK or TRYAGAIN (it ran
    none of them) go again where they belong (:func:`batchq.client.redirects.follow_redirects`).
    Where the calling thread holds the client (:func:`batchq.client.redis_internals.hold`:
    the producer's serving thread, the trainer's reader) its connection is taken from the
    pool without the pool's checks, else the pool lends one.

    Args:
        client: the client whose connection carries the commands.
        commands: each command's name and arguments.
        what: what the commands do, for a connection error's message.
        between: work to do while the commands travel (after the write, before the
            first read; once, not again on a NOSCRIPT resend). It must not use Redis
            on this thread (the connection is not idle) and must not raise.
        keep_errors: return error replies in place instead of raising the first
            (NOSCRIPT is still handled): for a caller that must know which of its
            commands went through (a push that went through while its lease hit OOM).
        readers: how each command's reply is read (None, or a None in it: raw, as
            Redis replies): :func:`batchq.client.redis_internals.read_bulk_into` for a
            value received into a buffer of its own, or redis-py's parsing
            (:func:`execute_pipeline`).

    Returns:
        The replies, in order.

    Raises:
        ConnectionLost: the connection failed or timed out.
        AuthFailed: the server refused the credentials or a permission.
        redis.ResponseError: the first error reply (OOM, WRONGTYPE...), as redis-py
            raises it.
    """
    try:
        replies = _send_and_read(client, commands, between, readers)
        if any(isinstance(r, REDIRECTS) for r in replies):  # a cluster's slot moved, or moves
            replies = follow_redirects(
                client, commands, replies, readers,
                lambda again, read: _send_and_read(client, again, None, read), load_all,
            )  # fmt: skip
        _send_refused_again(client, commands, replies, readers)
        errors = [r for r in replies if isinstance(r, redis.ResponseError)]
        if errors and not keep_errors:
            raise errors[0]
        refused_again = [e for e in errors if isinstance(e, NoScriptError)]
        if refused_again:
            raise refused_again[0]
        return replies
    except redis.RedisError as e:
        converted = convert_error(e, what, client)
        if converted is None:
            raise
        raise converted from e


def _send_refused_again(
    client: redis.Redis,
    commands: Sequence[Command],
    replies: list[Any],
    readers: Sequence[Reader | None] | None,
) -> None:
    """The commands refused with NOSCRIPT sent again once, alone and in their order,
    after loading every script; their replies put in place. The others ran: a push is
    not idempotent (sent twice, its frame was listed twice)."""
    refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if not refused:
        return
    load_all(client)
    reads = [readers[i] for i in refused] if readers is not None else None
    again = _send_and_read(client, [commands[i] for i in refused], None, reads)
    for i, reply in zip(refused, again, strict=True):
        replies[i] = reply


def _send_and_read(
    client: redis.Redis,
    commands: Sequence[Command],
    between: Callable[[], None] | None,
    readers: Sequence[Reader | None] | None,
) -> list[Any]:
    """One write, ``between()``, then one read per command; error replies are returned
    in place."""
    conn, direct = borrow(client)  # the owner thread's connection, or the pool's
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        if between is not None:
            between()
        replies: list[Any] = []
        for i in range(len(commands)):
            read = readers[i] if readers is not None else None
            try:
                replies.append(conn.read_response() if read is None else read(conn))
            except redis.ResponseError as e:  # read whole: the connection is in step
                replies.append(e)
        return replies
    except BaseException:
        # Half-read (a drop, a timeout, an interrupt): its next reader would get our
        # replies. redis-py's read_response already closed it for socket errors.
        conn.disconnect()
        raise
    finally:
        give_back(client, conn, direct)
