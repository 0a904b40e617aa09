"""What a collate_fn returns, as named sources; an IterableDataset's arguments (no Redis)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import IterableDataset, TensorDataset, get_worker_info  # noqa: E402

from batchq.errors import ConfigError  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch import DatasetStream, IterableDatasetStream  # noqa: E402
from producer.torch.sources import SourceLayout, flatten  # noqa: E402


def test_names_follow_the_structure() -> None:
    t = torch.arange(6).reshape(2, 3)
    names, values = flatten({"image": t, "meta": {"label": t[:, 0], "tags": ["a", "b"]}})
    assert names == ("image", "meta.label", "meta.tags")
    assert values[2] == ["a", "b"]  # no tensor inside: one msgpack value
    assert flatten((t, (t, {"m": t}), [1, 2]))[0] == ("0", "1.0", "1.1.m", "2")
    assert flatten(t)[0] == ("0",)
    assert flatten([[1, 2], [3]])[0] == ("0", "1")  # the top level is always positions


def test_a_tensor_travels_as_a_view_of_its_memory() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    (_, (arr,)) = flatten((t,))
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr()
    (_, (grad,)) = flatten((torch.ones(2, requires_grad=True),))
    assert grad.tolist() == [1.0, 1.0]


def test_bfloat16_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"source '0'.*bfloat16.*cast it to float32"):
        flatten((torch.ones(2, dtype=torch.bfloat16),))


def test_sources_name_positions_never_dict_keys() -> None:
    assert SourceLayout(("0", "1"), False, ("images", "labels")).sources == ("images", "labels")
    with pytest.raises(ConfigError, match=r"hold 2 values \(0, 1\); expected 2 distinct"):
        SourceLayout(("0", "1"), False, ("images",))
    with pytest.raises(ConfigError, match="whose keys"):
        SourceLayout(("a",), True, ("b",))


def test_a_batch_of_another_structure_is_an_error_naming_both() -> None:
    layout = SourceLayout(("0", "1"), False, None)
    with pytest.raises(ConfigError, match=r"\('0',\).*expected \('0', '1'\)"):
        layout.values((torch.ones(1),))


def test_a_dict_batch_streams_with_its_keys() -> None:
    ds = TensorDataset(torch.arange(10))
    stream = DatasetStream(
        ds, batch_size=4, collate_fn=lambda ex: {"x": torch.stack([e[0] for e in ex])}
    )
    assert stream.sources == ("x",)
    assert [b[0].tolist() for b in stream.get_epoch_iterator()] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]


class Numbers(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        info = get_worker_info()
        assert info is not None
        return iter(range(info.id, self.n, info.num_workers))


def test_an_iterable_dataset_is_a_shard_per_worker() -> None:
    ds = Numbers(10)
    inits: list[int] = []
    stream = DatasetStream(
        ds, batch_size=2, drop_last=True, num_shards=3, worker_init_fn=inits.append
    )
    assert isinstance(stream, IterableDatasetStream)
    plan = ShardPlan(stream)
    assert plan.shards == 3 and not plan.map_only
    got = [[b[0].tolist() for b in plan.iter_shard(2, s)] for s in range(3)]
    assert got == [[[0, 3], [6, 9]], [[1, 4]], [[2, 5]]]  # each shard's last short batch dropped
    assert ds.epochs[-3:] == [2, 2, 2] and inits[-3:] == [0, 1, 2]
    assert get_worker_info() is None  # restored after each pull


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"shuffle": True}, "expected unspecified shuffle option"),
        ({"sampler": [0]}, "expected unspecified sampler option"),
        ({"generator": torch.Generator()}, "batch_sampler and generator are not used"),
        ({"num_shards": 0}, "num_shards 0 is not valid"),
        ({"batch_size": None, "drop_last": True}, "batch_size=None option"),
    ],
)
def test_an_iterable_datasets_bad_arguments(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DatasetStream(Numbers(4), **kw)
