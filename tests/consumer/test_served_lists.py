"""A list batch over the server: the array Fuel's server sent where numpy makes one.

Fuel's ``send_arrays`` made every value of a batch a contiguous array
(``numpy.ascontiguousarray``), so the trainer of Fuel's server page, whose dataset is a
list of lists, received ``(100, 128)`` int arrays while the same stream in-process
yields lists. Before, batchq sent such a batch as a msgpack list of lists: a Fuel
trainer doing ``batch.shape`` broke. Values numpy cannot make into an array of their
own kind (ragged, mixed, dicts, None) still arrive as the values they are.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipelines import fuel_tutorial

from consumer import ServerDataStream
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.streams import DataStream

# Fuel's server.py, ported by its imports, run as its own process.
SERVE = """
import sys
from pipelines import fuel_tutorial
from producer import start_server
sys.exit(start_server(fuel_tutorial(0.005), url=sys.argv[1], queue=sys.argv[2]))
"""


def test_the_tutorial_in_process_yields_lists_as_fuel() -> None:
    batches = [features for (features,) in fuel_tutorial().get_epoch_iterator()]
    assert len(batches) == 10
    assert all(isinstance(b, list) and len(b) == 100 for b in batches)
    assert all(example == [0] * 128 for b in batches for example in b)


# 'auto': through shared memory on this host; 'redis': the trainer opts out, the
# frames travel through Redis.
@pytest.mark.parametrize("transport", ["auto", "redis"])
def test_the_tutorial_served_by_start_server_yields_fuels_arrays(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_env: Any, transport: str
) -> None:
    proc = spawn_proc([sys.executable, "-c", SERVE, redis_url, queue_name], env=serve_env())
    stream = ServerDataStream(
        ("features",), False, url=redis_url, queue=queue_name, transport=transport, timeout_s=30
    )
    with stream:
        for _ in range(2):
            batches = [features for (features,) in stream.get_epoch_iterator()]
            assert len(batches) == 10
            for features in batches:
                assert isinstance(features, np.ndarray)
                assert features.shape == (100, 128)
                assert features.dtype == np.int64
                assert not features.any()
        stream.close(finished=True)
    assert proc.wait(timeout=30) == 0


def mixed_values() -> Any:
    """Sources of every kind of list a batch of 2 may hold, 4 examples each."""
    sources = OrderedDict(
        [
            ("regular", [[i, i + 1] for i in range(4)]),  # (2, 2) int arrays
            ("strings", ["a", "bc", "d", "ef"]),  # <U2 arrays
            ("flags", [True, False, False, True]),  # bool arrays
            ("ragged", [[0], [1, 2], [3], [4, 5, 6]]),
            ("mixed", [1, "a", 2.5, None]),
            ("ints_floats", [1, 2.5, 3, 4.5]),  # not made float: stays as it is
            ("bools_ints", [True, 2, False, 3]),
            ("dicts", [{"a": 1}, {"b": [2]}, {"c": None}, {}]),
            ("nul_ending", ["a\0", "b", "c", "d\0"]),  # numpy would drop the NULs
        ]
    )
    return DataStream.default_stream(
        IndexableDataset(sources), iteration_scheme=SequentialScheme(examples=4, batch_size=2)
    )


def test_lists_arrive_as_arrays_only_where_numpy_holds_exactly_their_values(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    local = list(mixed_values().get_epoch_iterator(as_dict=True))
    producer_thread(mixed_values())
    with ServerDataStream(None, False, url=redis_url, queue=queue_name, timeout_s=20) as stream:
        served = list(stream.get_epoch_iterator(as_dict=True))
        stream.close(finished=True)
    assert len(served) == len(local) == 2
    for got, want in zip(served, local, strict=True):
        assert all(isinstance(v, list) for v in want.values())  # in-process: lists, as Fuel
        for name in ("regular", "strings", "flags"):
            assert isinstance(got[name], np.ndarray), name
            assert got[name].dtype == np.asarray(want[name]).dtype
            assert got[name].tolist() == want[name]
        for name in ("ragged", "mixed", "ints_floats", "bools_ints", "dicts", "nul_ending"):
            assert got[name] == want[name], name
            assert [type(v) for v in got[name]] == [type(v) for v in want[name]], name
