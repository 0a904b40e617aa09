"""ServerDataStream's constructor arguments: each wrong one is named, with what was expected."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.errors import ConfigError
from consumer import ServerDataStream
from consumer.group_session import check_group_state
from consumer.stream_options import check_stream_options

GOOD: dict[str, Any] = {
    "sources": ("x",), "hwm": 10, "timeout_s": 1.0, "on_bad_frame": "raise",
    "on_producer_error": "skip", "rank": 0, "world_size": 2, "even_batches": "pad",
}  # fmt: skip


def test_good_options_pass() -> None:
    check_stream_options(dict(GOOD))
    check_stream_options(dict(GOOD, sources=None, rank=1))


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("sources", "x", "expected a tuple of distinct names"),
        ("sources", ("x", "x"), "expected a tuple of distinct names"),
        ("hwm", 0, "hwm 0 is not valid"),
        ("hwm", 2.5, "hwm 2.5 is not valid"),
        ("timeout_s", 0, "expected > 0"),
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
