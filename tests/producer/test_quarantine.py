"""producer.quarantine in this process: the substitutes are a pure function of (seed,
epoch, index), whatever a producer met before; Hugging Face datasets; the cap; bad
arguments named. (Served by producer processes: tests/producer/test_torch_quarantine.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fuel_quarantine import iterable_stream  # noqa: E402
from torch_pipelines import BrokenExamples, SplitRange  # noqa: E402

from batchq.errors import ConfigError  # noqa: E402
from producer.errors import QuarantineExceeded  # noqa: E402
from producer.quarantine import set_sample_errors  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch import DatasetStream  # noqa: E402

BAD = {3, 40, 41}


def stream(mode: str = "quarantine", fraction: float = 0.05, n: int = 100) -> DatasetStream:
    return DatasetStream(
        BrokenExamples(n, BAD), batch_size=8, shuffle=True,
        generator=torch.Generator().manual_seed(4), sources=("index", "aug"),
        on_sample_error=mode, max_quarantined=fraction,
    )  # fmt: skip


def shard_bytes(s: Any, epoch: int, shard: int) -> list[tuple[bytes, ...]]:
    return [
        tuple(np.asarray(v).tobytes() for v in b) for b in ShardPlan(s).iter_shard(epoch, shard)
    ]


def test_substitutes_are_the_same_whatever_the_producer_met_before() -> None:
    first = stream()
    plan = ShardPlan(first)
    seen = {(e, k): shard_bytes(first, e, k) for e in range(2) for k in range(plan.shards)}
    for e in range(2):
        indices = [np.frombuffer(seen[e, k][0][0], np.int64) for k in range(plan.shards)]
        flat = [int(i) for b in indices for i in b]
        assert not BAD & set(flat) and len(flat) == 100  # every batch full, none bad
    assert first.sample_errors is not None and first.sample_errors.known_bad == BAD
    # A producer that builds the shards in another order, alone (a rebuild elsewhere),
    # and one that met every bad example already: the same bytes.
    for k in reversed(range(plan.shards)):
        assert shard_bytes(stream(), 1, k) == seen[1, k]
        assert shard_bytes(first, 1, k) == seen[1, k]


def test_a_hugging_face_dataset_whose_transform_raises_keeps_full_batches() -> None:
    datasets = pytest.importorskip("datasets")

    def transform(batch: dict[str, list[Any]]) -> dict[str, Any]:
        if set(batch["label"]) & BAD:
            raise OSError(f"cannot decode {sorted(set(batch['label']) & BAD)}")
        return {"label": torch.tensor(batch["label"]), "x": torch.rand(len(batch["label"]))}

    ds = datasets.Dataset.from_dict({"label": list(range(60))})
    ds.set_transform(transform)
    s = DatasetStream(
        ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(2),
        on_sample_error="quarantine", max_quarantined=0.1,
    )  # fmt: skip
    plan = ShardPlan(s)
    labels = [int(i) for k in range(plan.shards) for b in plan.iter_shard(0, k) for i in b[0]]
    assert len(labels) == 60 and not BAD & set(labels)
    records = s.sample_errors.records.listing(10)  # type: ignore[union-attr]
    assert sorted(r["index"] for r in records) == sorted(BAD)
    assert {r["error_type"] for r in records} == {"OSError"}


def test_past_max_quarantined_the_build_raises_naming_the_examples() -> None:
    s = stream(fraction=0.02)  # 2 of 100 examples may be quarantined: 3 raise
    plan = ShardPlan(s)
    with pytest.raises(QuarantineExceeded, match=r"3 examples quarantined") as caught:
        for k in range(plan.shards):
            list(plan.iter_shard(0, k))
    for i in BAD:
        assert f"{i} (ValueError: example {i}: truncated record)" in str(caught.value)


def test_without_quarantine_the_examples_error_is_raised_as_before() -> None:
    with pytest.raises(ValueError, match=r"example \d+: truncated record"):
        plan = ShardPlan(stream(mode="raise"))  # its probe batch may hold one
        for k in range(plan.shards):
            list(plan.iter_shard(0, k))


@pytest.mark.parametrize(
    ("mode", "fraction", "named"),
    [("skip", 0.01, "on_sample_error 'skip'"), ("quarantine", 1.5, "max_quarantined 1.5")],
)
def test_bad_arguments_are_named(mode: str, fraction: float, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        stream(mode=mode, fraction=fraction)
    with pytest.raises(ConfigError, match=named):
        set_sample_errors(stream(), mode, fraction)


def test_start_servers_arguments_need_a_stream_that_reads_examples() -> None:
    # (A Fuel pipeline reading examples by index takes them: test_fuel_quarantine.py.)
    with pytest.raises(ConfigError, match="expected an iteration scheme whose requests are"):
        set_sample_errors(iterable_stream(), "quarantine", None)
    s = stream(mode="raise")
    set_sample_errors(s, "quarantine", 0.2)
    assert s.sample_errors is not None and s.sample_errors.quarantine
    assert s.sample_errors.limit == 20
    assert s.plan_fingerprint["on_sample_error"] == "quarantine"  # producers must agree


def test_an_iterable_dataset_has_no_example_to_replace() -> None:
    with pytest.raises(ConfigError, match="expected a map-style dataset"):
        DatasetStream(SplitRange(10), batch_size=2, num_shards=2, on_sample_error="quarantine")
