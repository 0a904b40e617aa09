"""ServerDataStream's constructor arguments: each wrong one is named, with what was expected."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

from batchq.errors import ConfigError
from consumer import ServerDataStream
from consumer.checkpoint import check_group_state
from consumer.stream_options import check_stream_options, find_rank

GOOD: dict[str, Any] = {
    "sources": ("x",), "hwm": 10, "timeout_s": 1.0, "on_bad_frame": "raise",
    "on_producer_error": "skip", "rank": 0, "world_size": 2, "even_batches": "pad",
}  # fmt: skip


def test_good_options_pass() -> None:
    check_stream_options(dict(GOOD))
    check_stream_options(dict(GOOD, sources=None, rank=1))
    check_stream_options(dict(GOOD, timeout_s=np.int64(30), stall_s=np.float32(2.5)))


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("sources", "x", "expected a tuple of distinct names"),
        ("sources", ("x", "x"), "expected a tuple of distinct names"),
        ("hwm", 0, "hwm 0 is not valid"),
        ("hwm", 2.5, "hwm 2.5 is not valid"),
        ("timeout_s", 0, "expected > 0"),
        ("timeout_s", "5", "timeout_s '5' is not valid: expected > 0 (seconds)"),
        ("timeout_s", float("nan"), "timeout_s nan is not valid"),
        ("claim_ttl_s", 0, "claim_ttl_s 0 is not valid"),
        ("stall_s", "1", "stall_s '1' is not valid"),
        ("max_frame_bytes", -5, "expected None or an integer >= 1"),
        ("max_frame_bytes", "9", "max_frame_bytes '9' is not valid"),
        ("on_bad_frame", "ignore", "'raise' or 'skip'"),
        ("on_producer_error", None, "on_producer_error None"),
        ("rank", 2, "expected an integer in [0, 2)"),
        ("world_size", 0, "world_size"),
        ("even_batches", "round", "even_batches"),
        ("group", "trial 3", "group 'trial 3' is not valid"),
        ("group", "", "group '' is not valid"),
        ("max_lag_batches", -1, "max_lag_batches -1 is not valid"),
        ("max_lag_batches", True, "max_lag_batches True is not valid"),
    ],
)
def test_a_wrong_option_is_named(name: str, value: Any, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_stream_options(dict(GOOD, **{name: value}))
    assert says in str(info.value)


def test_the_stream_checks_them_when_built() -> None:
    with pytest.raises(ConfigError, match="hwm -1"):
        ServerDataStream(("x",), hwm=-1)


def test_a_state_of_another_group_is_refused() -> None:
    state = {"version": 1, "queue": "q", "run": "", "fingerprint": "", "group": "a"}
    assert check_group_state(state, "a") == state
    with pytest.raises(ConfigError, match="state is of group 'a', this stream reads group 'b'"):
        check_group_state(state, "b")
    stream = ServerDataStream(("x",), queue="q", group="b")
    with pytest.raises(ConfigError, match="group 'a'"):
        stream.load_state_dict(state)
    assert check_group_state({"run": ""}, "b") == {"run": ""}  # saved before groups


def test_ranks_not_given_are_found_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert find_rank(None, None) == (0, 1)  # a single process
    assert find_rank(1, 3) == (1, 3)
    with pytest.raises(ConfigError, match="rank=1 without world_size, and no torch"):
        find_rank(1, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert find_rank(None, None) == (0, 1)  # RANK and WORLD_SIZE both, or neither
    monkeypatch.setenv("RANK", "1")
    assert find_rank(None, None) == (1, 2)
    assert find_rank(0, None) == (0, 2)  # explicit arguments win
    with pytest.raises(ConfigError, match=r"world_size=3 differs from the environment's .* \(2\)"):
        find_rank(None, 3)  # as the process group's: its own layout needs its rank
    assert find_rank(2, 3) == (2, 3)
    stream = ServerDataStream(("x",), queue="q")
    assert (stream.rank, stream.world_size) == (1, 2)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ConfigError, match="RANK='one' and WORLD_SIZE='2'"):
        find_rank(None, None)


def test_ranks_are_found_again_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    stream = ServerDataStream(("x",), queue="q")  # made before the job's ranks are known
    assert (stream.rank, stream.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    stream.load_state_dict({"version": 1, "queue": "q", "run": "", "fingerprint": ""})
    assert (stream.rank, stream.world_size, stream.options.rank) == (3, 4, 3)


def test_ranks_come_from_an_initialised_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setenv("RANK", "5")  # the process group wins over the environment
    monkeypatch.setenv("WORLD_SIZE", "8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert find_rank(None, None) == (0, 1)
        assert ServerDataStream(("x",), queue="q").world_size == 1
        with pytest.raises(ConfigError, match=r"rank=1 contradicts .* \(rank 0 of world_size 1\)"):
            ServerDataStream(("x",), queue="q", rank=1)
        with pytest.raises(ConfigError, match=r"world_size=2 differs .* \(1\): pass rank="):
            find_rank(None, 2)
        assert find_rank(1, 2) == (1, 2)  # a data-parallel layout of its own: as given
    finally:
        dist.destroy_process_group()
