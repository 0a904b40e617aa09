"""producer.control: the params in effect for the batch being built, per batch (also
where a chain reads one batch ahead), and the log a producer reads again only when the
lease's stamp says it changed."""

from __future__ import annotations

import json
import threading
from typing import Any

import fakeredis
import numpy as np
import pytest

from batchq.protocol.keys import QueueKeys
from batchq.protocol.params_log import ParamsLog, thaw
from producer import control
from producer.control import ProducerParams
from producer.datasets import IndexableDataset
from producer.schemes import ConstantScheme, SequentialScheme
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream
from producer.transformers import Batch, Transformer, Unpack

LOG = ParamsLog().add(2, {"level": 1}).add(5, {"level": 2, "tag": ["x"]})


def test_params_are_empty_outside_a_served_batch() -> None:
    assert control.params() == {} and control.params_version() == 0
    assert control.batch_index() is None and len(control.params_log()) == 0


def test_building_sets_the_batch_index_its_params_and_the_whole_log() -> None:
    with control.building(LOG, 6) as state:
        assert control.params() == {"level": 2, "tag": ("x",)}
        assert control.params_version() == 2 == state.version
        assert control.batch_index() == 6 and control.params_log() is LOG
        with pytest.raises(TypeError):
            control.params()["level"] = 3  # type: ignore[index]
        with control.building(LOG, 3):
            assert control.params() == {"level": 1}
        assert control.batch_index() == 6
    assert control.params() == {}


def test_each_thread_sees_its_own_batch() -> None:
    seen: dict[str, Any] = {}
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        seen["before"] = dict(control.params())
        with control.building(LOG, 2):
            entered.set()
            release.wait(5)
            seen["inside"] = dict(control.params())

    with control.building(LOG, 9):
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(5)
        assert control.params()["level"] == 2  # not the other thread's
        release.set()
        thread.join(5)
    assert seen == {"before": {}, "inside": {"level": 1}}


class Recorder(Transformer):
    """Passes batches on, recording the batch index and params each was built under."""

    def __init__(self, data_stream: Any) -> None:
        super().__init__(data_stream, data_stream.produces_examples)
        self.built: list[tuple[int | None, Any]] = []

    def get_data(self, request: Any = None) -> Any:
        batch = next(self.child_epoch_iterator)
        self.built.append((control.batch_index(), thaw(control.params())))
        return batch


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_shard_spanning_a_change_builds_each_batch_under_its_own_params(
    lookahead: bool,
) -> None:
    # One shard of 8 batches (requests_per_shard=8): the change at 5 falls inside it.
    # Batch over Unpack counts its batches but is read one batch ahead.
    dataset = IndexableDataset({"x": np.arange(16)})
    root = DataStream(dataset, iteration_scheme=SequentialScheme(16, 2))
    chain = Batch(Unpack(root), ConstantScheme(2)) if lookahead else root
    stream = Recorder(chain)
    plan = ShardPlan(stream, requests_per_shard=8)
    assert plan.shard_batches == 8 and plan.map_only is not lookahead
    source = ProducerParams(QueueKeys("q"), plan.shard_batches or 0)
    source.log = LOG
    shard = source.shard(0)
    batches = list(plan.iter_shard_marked(0, 0, shard.around))
    assert [last for _, last in batches] == [False] * 7 + [True]
    assert [shard.version(k) for k in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]
    # Read one ahead, batch k+1 is pulled while batch k is handed out: still under its
    # own index.
    assert [index for index, _ in stream.built] == list(range(8))
    assert stream.built[5][1] == {"level": 2, "tag": ["x"]}


def test_a_producer_reads_the_log_again_only_when_the_stamp_changed() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(version=(6, 2)))
    keys = QueueKeys("q")
    stored = {"run": "r1", "entries": LOG.to_json()}
    client.set(keys.params, json.dumps(stored))
    source = ProducerParams(keys, 1)
    source.joined("r1")
    reads = 0
    getrange = client.getrange

    def counted(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        return getrange(*args)

    client.getrange = counted  # type: ignore[method-assign]
    source.follow(client, "r1:2")
    source.follow(client, "r1:2")
    assert reads == 1 and source.log == LOG and source.current("r1:2")
    source.joined("r2")  # another run: its log is not this one's
    source.follow(client, "r2:2")
    assert len(source.log) == 0 and reads == 2
    client.set(keys.params, b"{not json")
    source.follow(client, "r2:3")  # not batchq's: logged, served without params
    assert len(source.log) == 0


def test_a_torch_datasets_getitem_reads_the_params_of_its_batch() -> None:
    pytest.importorskip("torch")
    from producer.torch.dataset import DatasetStream

    class Scaled:
        """A map-style dataset whose examples are scaled by the params' ``scale``."""

        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> Any:
            return {"x": i * control.params().get("scale", 1)}

    plan = ShardPlan(DatasetStream(Scaled(), batch_size=3))
    source = ProducerParams(QueueKeys("q"), plan.shard_batches)
    source.log = ParamsLog().add(2, {"scale": 10})
    got = []
    for shard in range(plan.shards):
        batches = plan.iter_shard_marked(0, shard, source.shard(shard).around)
        got += [[int(v) for v in batch[0]] for batch, _ in batches]
    assert got == [[0, 1, 2], [3, 4, 5], [60, 70, 80], [90, 100, 110]]
