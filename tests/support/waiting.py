"""Bounded waits for tests: a condition either holds within the timeout or the test fails."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import IO, Any

import pytest


def wait_until(cond: Callable[[], Any], timeout_s: float = 15.0, what: str = "") -> Any:
    """Poll ``cond`` every 10 ms until it is truthy; fail the test after ``timeout_s``.

    Used only to wait for a state another process reaches (a producer joined, a list
    filled), never to let time pass.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what or cond}")


def read_until(stream: IO[bytes] | None, text: bytes, timeout_s: float = 60.0) -> bytes:
    """Read a child's pipe byte by byte until what was read ends with ``text`` (nothing
    past it is taken); fail the test after ``timeout_s`` or if the child closes it."""
    assert stream is not None
    fd, buf, deadline = stream.fileno(), b"", time.monotonic() + timeout_s
    while not buf.endswith(text):
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        if not ready:
            pytest.fail(f"no {text!r} from the child within {timeout_s} s (got {buf[-800:]!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            pytest.fail(f"the child closed its output before {text!r} (got {buf[-800:]!r})")
        buf += chunk
    return buf
