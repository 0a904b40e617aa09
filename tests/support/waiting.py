"""Bounded waits for tests: a condition either holds within the timeout or the test fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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
