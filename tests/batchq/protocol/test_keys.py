"""The key layout: one module names every key; all carry the queue's hash tag."""

from __future__ import annotations

import pytest

from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys, check_name, queue_from_meta_key


def test_every_key_carries_the_hash_tag_and_only_data_says_data() -> None:
    k = QueueKeys("q1")
    names = [
        k.meta,
        k.data,
        k.wake,
        k.work,
        k.producers,
        k.ledger,
        k.incarnation,
        k.stats,
        k.dead,
        k.lease("p1"),
        k.frame("r1", "p1", 7),
    ]
    assert all(n.startswith("bq:{q1}:") for n in names)
    assert [n for n in names if "data" in n] == [k.data]
    assert k.frame("r1", "p1", 7).startswith(k.frame_prefix)
    # The run is in a frame's name: an older run's frames are told from the run's.
    assert k.frame("r1", "p1", 7).startswith(k.run_frames("r1"))
    assert not k.frame("r10", "p1", 7).startswith(k.run_frames("r1"))


@pytest.mark.parametrize("bad", ["", "a b", "x{y}", "a:b", "é", "x" * 129, 5])
def test_bad_names_are_refused_with_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="expected 1-128 characters"):
        check_name(bad, "queue")  # type: ignore[arg-type]


def test_meta_key_names_its_queue() -> None:
    assert queue_from_meta_key(b"bq:{tutorial}:meta") == "tutorial"
    assert queue_from_meta_key("bq:{tutorial}:data") is None
    assert queue_from_meta_key("other") is None
