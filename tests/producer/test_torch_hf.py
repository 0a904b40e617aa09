"""A Hugging Face ``datasets.Dataset`` served through DatasetStream (made offline with
``Dataset.from_dict``; nothing is downloaded), in the formats the README lists."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from torch_pipelines import HF_EXAMPLES, hf_stream  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402


def test_batches_are_read_with_the_datasets_batch_access(monkeypatch: Any) -> None:
    calls: list[Any] = []
    stream = hf_stream("transform")
    real = type(stream.dataset).__getitems__
    monkeypatch.setattr(
        type(stream.dataset),
        "__getitems__",
        lambda self, keys: calls.append(keys) or real(self, keys),
    )
    plan = ShardPlan(stream)
    (batch,) = plan.iter_shard(0, 0)
    assert calls[-1] == plan.requests(0)[0]  # one call for the whole batch
    assert stream.sources == ("x", "label", "name")
    assert [int(v) for v in batch[1]] == plan.requests(0)[0]


@pytest.mark.parametrize("fmt", ["transform", "torch", "numpy"])
def test_a_datasets_dataset_is_served(
    fmt: str, redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    argv = serve_argv("--hwm", "4", "--arg", f"fmt={fmt}", factory="torch_pipelines:hf_stream")
    spawn_proc(argv, env=serve_env())
    plan = ShardPlan(hf_stream(fmt))
    stream = ServerDataStream(("x", "label", "name"), False, url=redis_url, queue=queue_name)
    with TorchStream(stream, as_dict=True) as ts:
        for e in range(2):
            epoch = list(ts)
            assert len(epoch) == HF_EXAMPLES // 8
            labels = [int(v) for b in epoch for v in b["label"]]
            assert labels == [i for r in plan.requests(e) for i in r]  # the shuffled order
            for b in epoch:
                x, label = b["x"], b["label"]
                assert isinstance(x, torch.Tensor) and x.shape == (8, 3)
                base = label.to(torch.float32)[:, None]
                if fmt == "transform":  # the transform's noise, drawn per batch
                    assert bool(((x >= base) & (x < base + 1)).all()) and not torch.equal(
                        x, base.expand(8, 3)
                    )
                else:
                    assert torch.equal(x, base.expand(8, 3))
                assert [str(n) for n in b["name"]] == [f"ex{int(i)}" for i in label]
        ts.close(finished=True)
    want = [np.asarray(b[0]).tobytes() for s in range(plan.shards) for b in plan.iter_shard(1, s)]
    assert [t["x"].numpy().tobytes() for t in epoch] == want  # the same bytes as built here
