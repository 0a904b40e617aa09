"""producer.serving.build_watch: a build's result or error as if called in place; past
build_timeout_s a BuildTimeout naming what was read, and nothing more runs."""

from __future__ import annotations

import threading

import pytest

from producer.errors import BuildTimeout
from producer.serving.build_watch import BuildWatch


def test_a_build_returns_or_raises_as_if_called_here() -> None:
    watch = BuildWatch(5.0, lambda: "")
    assert watch.call(lambda: 41 + 1, "batch 0") == 42
    with pytest.raises(KeyError, match="boom"):
        watch.call(lambda: {}["boom"], "batch 1")
    assert watch.hung is None and watch.call(lambda: "again", "batch 2") == "again"


def test_a_build_past_the_timeout_names_what_it_read_and_the_watch_stops() -> None:
    release = threading.Event()
    watch = BuildWatch(0.05, lambda: "example 7")
    with pytest.raises(BuildTimeout, match=r"batch 3: no batch after build_timeout_s=0.05 "
                       r"\(reading example 7\)"):  # fmt: skip
        watch.call(lambda: release.wait(30), "batch 3")
    ran = []
    with pytest.raises(BuildTimeout):  # the hung build still runs: nothing else may
        watch.call(lambda: ran.append(1), "batch 4")
    release.set()
    assert ran == []
