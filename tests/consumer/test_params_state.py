"""The params log in checkpoints: carried by state_dict, checked when loaded, kept by an
elastic resume (the longest of the ranks' logs), and the trainer-side checks of
set_params' arguments that need no producer."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.errors import ConfigError
from batchq.protocol.params_log import ParamsLog
from batchq.protocol.ranks import BatchNumbering, RankLayout
from consumer import ServerDataStream
from consumer.checkpoint import check_state
from consumer.params import change_index, positions
from consumer.rank_state import elastic_state

LOG = ParamsLog().add(5, {"level": 1}, "c1").add(9, {"level": 2}, "c2")


def state(rank: int, log: ParamsLog) -> dict[str, Any]:
    return {
        "version": 1, "queue": "q", "run": "r1", "fingerprint": "f", "shards": 3,
        "plan_shards": 12, "epoch": 0, "consumed": {"0": 1}, "done": [], "rank": rank,
        "world_size": 4, "even_batches": "pad", "step": 1, "params": log.to_json(),
    }  # fmt: skip


def test_an_elastic_resume_keeps_the_longest_log() -> None:
    # Rank 3 saved before it learned the last change (a prefix of the run's log).
    states = [state(r, LOG if r < 3 else ParamsLog(LOG.entries[:1])) for r in range(4)]
    new = elastic_state(states, 0, 2)
    assert ParamsLog.from_json(new["params"]) == LOG
    mine = [*states[:3], state(3, ParamsLog().add(5, {"level": 9}))]
    with pytest.raises(ConfigError, match="disagree"):
        elastic_state(mine, 0, 2)


def test_a_bad_log_in_a_state_is_refused_naming_it() -> None:
    bad = state(0, LOG)
    bad["params"] = [{"version": 1, "index": -3, "params": {}}]
    with pytest.raises(ConfigError, match=r"state\['params'\]\[0\]\['index'\] = -3"):
        check_state(bad, "q")


def test_a_loaded_states_log_is_in_the_state_before_the_first_batch() -> None:
    stream = ServerDataStream(("x",), queue="q")
    saved = state(0, LOG) | {"world_size": 1, "rank": 0}
    del saved["plan_shards"], saved["step"], saved["even_batches"]
    stream.load_state_dict(saved)
    assert stream.state_dict()["params"] == LOG.to_json()
    assert stream.params == {}  # nothing yielded yet


def test_the_position_is_the_next_batch_in_plan_order_and_past_what_was_handed_out() -> None:
    numbering = BatchNumbering(RankLayout(10), stride=2, window=3)
    # 2 batches a shard; epoch 1: shards 0 and 1 done, 1 batch of shard 2 handed out.
    assert positions(numbering, (1, {0: 2, 1: 2, 2: 1}, [0, 1]), 0) == (25, 25)
    # Arrival order: shard 5 handed out completely past the position.
    assert positions(numbering, (1, {0: 1, 5: 2}, [5]), 0) == (21, 32)


@pytest.mark.parametrize(
    "at_batch, at_epoch, match",
    [
        (3, 1, "expected at most one"),
        (-1, None, "at_batch -1 is not valid"),
        (None, "1", "at_epoch '1' is not valid"),
        (True, None, "at_batch True is not valid"),
        (7, None, "at_batch 7 is in the past.*up to index 9"),
        (None, 0, r"at_epoch 0 \(batch 0\) is in the past"),
    ],
)
def test_where_a_change_applies_is_checked(at_batch: Any, at_epoch: Any, match: str) -> None:
    numbering = BatchNumbering(RankLayout(10), stride=1, window=3)
    with pytest.raises(ConfigError, match=match):
        change_index(numbering, at_batch, at_epoch, 10, 10)
    assert change_index(numbering, None, None, 10, 10) == 10 + 6  # position + D
    assert change_index(numbering, None, 2, 10, 10) == 20
