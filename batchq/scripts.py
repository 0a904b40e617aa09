"""Typed access to the Lua scripts in ``batchq/lua``.

Each script is called with EVALSHA; on NOSCRIPT (a new or restarted server) it is loaded
and the call is retried once. Scripts are never wrapped in redis-py ``Script`` objects
inside pipelines: those send SCRIPT EXISTS on every execute. Every key a script touches
is passed in KEYS (Redis Cluster needs that), and all of them carry the queue's hash tag.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from batchq.connection import convert_error

__all__ = ["SCRIPTS", "Script", "execute_pipeline", "load_all"]

Arg = str | bytes | bytearray | memoryview | int | float

_LUA_DIR = Path(__file__).resolve().parent / "lua"


class Script:
    """One Lua script of ``batchq/lua``.

    Args:
        name: the file name without ``.lua``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Next to this module, not resources.files("batchq"): run from a folder holding a
        # checkout named batchq, "batchq" is a namespace package over both, whose
        # MultiplexedPath cannot join two parts (TypeError) and may pick the wrong one.
        self.source = (_LUA_DIR / f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run the script, loading it first if the server does not know it.

        Raises:
            ConnectionLost: the connection failed.
        """
        try:
            try:
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                client.script_load(self.source)
                return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.RedisError as e:
            converted = convert_error(e, f"running {self.name}", client)
            if converted is None:
                raise
            raise converted from e

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Add an EVALSHA of this script to a pipeline (see :func:`execute_pipeline`)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


SCRIPTS: dict[str, Script] = {
    name: Script(name)
    for name in (
        "claim",
        "fail",
        "gone",
        "handback",
        "join",
        "lease",
        "pop",
        "push",
        "reap",
        "requeue",
        "resume",
    )
}


def load_all(client: redis.Redis) -> None:
    """Load every script into the server's script cache."""
    for script in SCRIPTS.values():
        client.script_load(script.source)


def execute_pipeline(client: redis.Redis, build: Any, *, raise_on_error: bool = True) -> list[Any]:
    """Run a pipeline built by ``build(pipe)``; on NOSCRIPT load the scripts and retry once.

    Rebuilding and resending the whole pipeline is safe because the pipelines batchq
    sends are idempotent (a SET of the same frame, then a script that had not run).

    Args:
        client: the client.
        build: a function that adds the commands to a fresh pipeline.
        raise_on_error: False returns a command's error (WRONGTYPE...) in its place.

    Returns:
        The replies, in order.

    Raises:
        ConnectionLost: the connection failed.
    """
    try:
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            build(pipe)
            try:
                replies = list(pipe.execute(raise_on_error=raise_on_error))
                if not raise_on_error and any(
                    isinstance(r, redis.exceptions.NoScriptError) for r in replies
                ):
                    raise redis.exceptions.NoScriptError("NOSCRIPT in a pipeline")
                return replies
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                load_all(client)
        raise AssertionError("unreachable")  # pragma: no cover
    except redis.RedisError as e:
        converted = convert_error(e, "running a pipeline", client)
        if converted is None:
            raise
        raise converted from e
