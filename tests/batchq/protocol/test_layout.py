"""batchq.protocol.layout: every format batchq writes into Redis, round-tripped."""

from __future__ import annotations

import os

import pytest

from batchq.protocol import layout
from batchq.protocol.keys import check_name


def test_a_lease_entry_names_its_slot_and_run() -> None:
    entry = layout.lease_entry(41, "r1", "p-1:7")  # a token may itself hold colons
    assert entry == "41:r1:p-1:7" and layout.entry_slot(entry) == 41
    assert layout.entry_run(entry) == "r1"
    grouped = layout.lease_entry(41, "r1", "p-1:7", mask=0b101)
    assert grouped == "41/5:r1:p-1:7" and layout.entry_slot(grouped) == 41
    assert layout.entry_run(grouped) == "r1"
    with pytest.raises(ValueError, match="41:t"):
        layout.entry_run("41:t")  # a token without its run


def test_a_ledger_field_round_trips_and_refuses_others() -> None:
    assert layout.parse_ledger_field(layout.ledger_field(3, 12)) == (3, 12)
    for bad in ("3", "3:x", "3:1:2"):
        with pytest.raises(ValueError):
            layout.parse_ledger_field(bad)


@pytest.mark.parametrize(("n", "final"), [(0, False), (7, False), (7, True), (0, True)])
def test_a_count_value_round_trips(n: int, final: bool) -> None:
    assert layout.parse_count_value(layout.count_value(n, final).encode()) == (n, final)
    assert layout.counts_field(2, 1) == "2:1"


def test_a_count_value_that_is_no_count_raises() -> None:
    with pytest.raises(ValueError):
        layout.parse_count_value(b"=x")


def test_time_ms_of_a_time_reply() -> None:
    assert layout.time_ms([b"1700000000", b"123456"]) == 1_700_000_000_123


def test_the_caps_are_positive_and_the_done_marker_is_short() -> None:
    caps = (layout.WAKE_CAP, layout.HISTORY_CAP, layout.DEAD_CAP, layout.SCALELOG_CAP)
    assert all(isinstance(c, int) and c > 0 for c in caps)
    assert layout.DONE == "d"


def test_a_default_id_names_its_host_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout.socket, "gethostname", lambda: "gpu box_7.lab")
    pid = layout.default_id()
    assert check_name(pid, "producer id") == pid
    assert layout.id_host(pid) == "gpu-box_7.lab"
    assert layout.id_pid(pid) == os.getpid()
    assert layout.default_id() != pid  # a new random part each time
    assert (layout.id_host("worker"), layout.id_pid("worker")) == ("worker", None)
    assert (layout.id_host("a-b-c"), layout.id_pid("a-b-c")) == ("a", None)
