"""The clock of a blocked push (producer/serving/waiting.py)."""

from __future__ import annotations

import pytest

from producer.serving import waiting
from producer.serving.waiting import HANDBACK_S, Waiting


def test_the_wait_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: now[0])
    wait = Waiting()
    assert wait.since_last_try_ms() == 0  # never blocked
    assert wait.start() is False  # the first block starts the clocks
    now[0] += 0.25
    assert wait.since_last_try_ms() == 250
    assert wait.since_last_try_ms() == 0  # each try reports only its own wait
    assert wait.start() is True
    assert not wait.hand_back_due()
    now[0] += HANDBACK_S
    assert wait.hand_back_due()
    assert not wait.hand_back_due()  # once per HANDBACK_S
    wait.restart()
    now[0] += 0.5
    assert wait.since_last_try_ms() == 500
