"""The params log's pure logic: the fold, the versions, retroactive changes, its JSON
forms, its caps and checks; the global batch numbering its indices count."""

from __future__ import annotations

import json
import math

import pytest

from batchq.errors import ConfigError
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES, params_stamp, parse_params_stamp
from batchq.protocol.params_log import ParamsLog, check_params, freeze, merged
from batchq.protocol.ranks import (
    BatchNumbering,
    RankLayout,
    batch_index,
    frame_index,
    lookahead_batches,
)


def test_params_at_an_index_fold_every_entry_at_or_before_it() -> None:
    log = ParamsLog().add(10, {"size": 64, "aug": 0.1}).add(20, {"size": 128})
    assert log.at(0) == (0, {})
    assert log.at(9) == (0, {})
    assert log.at(10) == (1, {"size": 64, "aug": 0.1})
    assert log.at(19) == (1, {"size": 64, "aug": 0.1})
    assert log.at(20) == (2, {"size": 128, "aug": 0.1})
    assert log.version == 2 and len(log) == 2


def test_a_retroactive_change_gives_every_later_batch_a_new_version() -> None:
    log = ParamsLog().add(30, {"a": 1}).add(12, {"a": 2, "b": "x"})
    # In (index, version) order: the change at 12 applies first, the one at 30 after it.
    assert log.at(11) == (0, {})
    assert log.at(12) == (2, {"a": 2, "b": "x"})
    assert log.at(30) == (2, {"a": 1, "b": "x"})  # version 2: built before, told apart
    assert [log.version_at(i) for i in (29, 30, 31)] == [2, 2, 2]
    # Two changes at one index: the later call wins.
    same = ParamsLog().add(5, {"a": 1}).add(5, {"a": 2})
    assert same.at(5) == (2, {"a": 2})


def test_params_handed_out_are_read_only_deep_copies() -> None:
    update = {"w": {"a": 1}, "sizes": [1, 2]}
    log = ParamsLog().add(0, update)
    update["w"]["a"] = 99  # the caller's object changing later changes nothing
    params = log.params_at(0)
    assert params["w"]["a"] == 1 and params["sizes"] == (1, 2)
    with pytest.raises(TypeError):
        params["w"]["a"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        params["new"] = 1  # type: ignore[index]
    assert freeze([{"x": [1]}]) == ({"x": (1,)},)


def test_json_forms_round_trip_exactly() -> None:
    log = ParamsLog().add(3, {"lr": 0.1 + 0.2, "name": "é"}, "c1").add(7, {"n": None}, "c2")
    again = ParamsLog.from_json(json.loads(json.dumps(log.to_json())))
    assert again == log
    assert again.params_at(3)["lr"] == 0.1 + 0.2  # floats exactly (JSON's repr)
    assert again.find("c2") == log.entries[1] and log.find("nope") is None
    stored = json.dumps({"run": "r1", "entries": log.to_json()})
    assert ParamsLog.from_stored(stored, "r1") == log
    assert ParamsLog.from_stored(stored, "another run") == ParamsLog()  # not this run's
    assert ParamsLog.from_stored(None, "r1") == ParamsLog()


@pytest.mark.parametrize(
    "bad, match",
    [
        (["not", "a", "mapping"], "expected a mapping"),
        ({1: "x"}, "has the key 1: expected str keys"),
        ({"a": math.nan}, "expected a finite number"),
        ({"a": {"b": object()}}, r"params\['a'\]\['b'\] = <object"),
        ({"a": b"bytes"}, "expected a JSON value"),
    ],
)
def test_bad_params_are_refused_naming_the_value(bad: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_params(bad)


def test_the_log_is_bounded() -> None:
    with pytest.raises(ConfigError, match="at most"):
        check_params({"x": "y" * PARAMS_LOG_MAX_BYTES})
    with pytest.raises(ConfigError, match="integer >= 0"):
        ParamsLog().add(-1, {})
    with pytest.raises(ConfigError, match="has version 2: expected 1"):
        ParamsLog.from_json([{"version": 2, "index": 0, "params": {}}])
    with pytest.raises(ConfigError, match="'index'"):
        ParamsLog.from_json([{"version": 1, "index": "3", "params": {}}])
    with pytest.raises(ConfigError, match="not JSON"):
        ParamsLog.from_stored(b"{nope", "r")
    with pytest.raises(ConfigError, match="over"):
        ParamsLog.from_stored(b"x" * (PARAMS_LOG_MAX_BYTES + 100), "r")


def test_logs_of_one_run_merge_to_the_longer_and_a_disagreement_is_refused() -> None:
    short = ParamsLog().add(1, {"a": 1})
    long = short.add(2, {"a": 2})
    assert merged(short, long) == long and merged(long, short) == long
    with pytest.raises(ConfigError, match="disagree"):
        merged(ParamsLog().add(1, {"a": 9}), long)


def test_the_stamp_names_the_run_and_the_version() -> None:
    assert parse_params_stamp(params_stamp("r1", 3)) == ("r1", 3)
    assert parse_params_stamp("") == ("", 0)


def test_global_batch_indices_follow_the_plan_numbering() -> None:
    assert batch_index(5, 2, 3) == 17
    assert batch_index(5, 2, 0) == 5  # a plan that cannot count a shard's batches
    assert frame_index(5, 3, 3) == 17  # a shard's END at k=3 counts as its last batch
    one = BatchNumbering(RankLayout(10), stride=1, window=8)
    assert one.epoch_first(2) == 20 and one.position(23, 0) == 23
    assert one.lookahead == lookahead_batches(8, 1, 1) == 16
    multi = BatchNumbering(RankLayout(10), stride=3, window=4)
    assert multi.position(23, 2) == 71 and multi.lookahead == 24
    # Ranks: the run's numbering, the same position on every rank at one step.
    ranks = BatchNumbering(RankLayout(10, world=4), stride=1, window=2)
    assert ranks.layout.slots == 12 and ranks.epoch_first(1) == 12
    # 3 local shards per rank: rank 3's local shard 4 is epoch 1's slot 1 * 4 + 3.
    assert ranks.local_index(4, 0, 3) == 12 + 7
    assert ranks.position(4, 0) == 12 + 4 and ranks.position(4, 1) == 12 + 8  # next round
    assert ranks.lookahead == (2 * 2 + 1) * 4
