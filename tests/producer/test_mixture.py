"""producer.mixture: batches drawn from sources by weight, the weights the params log
sets from a known batch on, each source's passes without repeats, any batch computable
on its own; and the mixture's checks."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import pytest
from mixing import check_passes

from batchq.errors import ConfigError
from batchq.protocol.params_log import ParamsLog
from producer import control
from producer.datasets import IndexableDataset
from producer.mixture import CHECKPOINT, Mixture
from producer.serving.sharding import ShardPlan
from producer.transformers import Mapping


def sources(n_a: int = 30, n_b: int = 20) -> dict[str, Any]:
    """'a': a Fuel dataset, 'b': a list of dicts, numbered apart (b's from 10000)."""
    return {
        "a": IndexableDataset({"x": np.arange(n_a, dtype=np.int64)}),
        "b": [{"x": np.int64(10_000 + i)} for i in range(n_b)],
    }


def batch(mixture: Mixture, g: int, log: ParamsLog) -> tuple[Any, ...]:
    """Batch g as a producer builds it under ``log``."""
    with control.building(log, g):
        return mixture.get_data(g)  # type: ignore[no-any-return]


def test_weights_set_from_a_known_batch_on_change_the_mix_there() -> None:
    mixture = Mixture(sources(), {"a": 1.0, "b": 0.0}, batch_size=8, batches_per_epoch=25, seed=3)
    log = ParamsLog().add(30, {"weights": {"a": 0.5, "b": 0.5}})
    labels = []
    per_source: dict[str, list[list[int]]] = {"a": [], "b": []}
    for g in range(130):
        x, source = batch(mixture, g, log)
        assert x.shape == (8,) and source.dtype.kind == "U"
        labels.append(list(source))
        for name in ("a", "b"):
            per_source[name].append([int(v) % 10_000 for v in x[source == name]])
        assert all((v >= 10_000) == (s == "b") for v, s in zip(x, source, strict=True))
    assert not any("b" in row for row in labels[:30])  # none of b before the change
    after = Counter(s for row in labels[30:] for s in row)
    n = 100 * 8
    assert abs(after["b"] - n * 0.5) <= 4 * math.sqrt(n * 0.25)
    check_passes(per_source["a"], 30)
    check_passes(per_source["b"], 20)


def test_any_batch_is_computed_alone_as_in_order() -> None:
    mixture = Mixture(sources(), {"a": 0.7, "b": 0.3}, batch_size=5, batches_per_epoch=10, seed=1)
    log = ParamsLog().add(CHECKPOINT + 10, {"weights": {"b": 1.0}})
    in_order = [batch(mixture, g, log) for g in range(CHECKPOINT + 40)]
    alone = Mixture(sources(), {"a": 0.7, "b": 0.3}, batch_size=5, batches_per_epoch=10, seed=1)
    for g in (CHECKPOINT + 39, 3, CHECKPOINT + 9, CHECKPOINT + 10):  # random access
        for mine, theirs in zip(batch(alone, g, log), in_order[g], strict=True):
            assert np.array_equal(mine, theirs)
    # A change of the weights after a batch leaves the batches before it alone.
    later = log.add(CHECKPOINT + 20, {"weights": {"a": 1.0}})
    assert np.array_equal(batch(alone, CHECKPOINT + 15, later)[0], in_order[CHECKPOINT + 15][0])
    assert all(s == "a" for s in batch(alone, CHECKPOINT + 25, later)[1])


def test_per_batch_draws_one_source_for_the_whole_batch() -> None:
    mixture = Mixture(
        sources(), {"a": 0.25, "b": 0.75}, batch_size=4, batches_per_epoch=50, seed=5,
        per="batch",
    )  # fmt: skip
    picked = []
    for g in range(400):
        _, source = batch(mixture, g, ParamsLog())
        assert len(set(source)) == 1
        picked.append(source[0])
    assert abs(picked.count("b") - 300) <= 4 * math.sqrt(400 * 0.75 * 0.25)


def test_in_process_it_is_a_stream_of_epochs_with_the_constructors_weights() -> None:
    mixture = Mixture(sources(), {"a": 1.0}, batch_size=6, batches_per_epoch=4, seed=2)
    epochs = [[b for b in mixture.get_epoch_iterator()] for _ in range(2)]
    assert [len(e) for e in epochs] == [4, 4] and mixture.sources == ("x", "source")
    assert all(set(source) == {"a"} for e in epochs for _, source in e)


class Pair(NamedTuple):
    image: int
    label: int


def test_sequence_sources_name_their_values() -> None:
    named = Mixture({"s": [Pair(i, -i) for i in range(5)]}, {"s": 1}, batch_size=3,
                    batches_per_epoch=2, seed=0)  # fmt: skip
    assert named.sources == ("image", "label", "source")
    image, label, _ = batch(named, 0, ParamsLog())
    assert list(label) == [-v for v in image]
    plain = Mixture({"s": [(i, i) for i in range(5)]}, {"s": 1}, batch_size=2,
                    batches_per_epoch=2, seed=0, names=("x", "y"), source_name="from")  # fmt: skip
    assert plain.sources == ("x", "y", "from")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weights": {"a": 1, "c": 1}}, r"name the sources \['c'\]"),
        ({"weights": {"a": 0, "b": 0}}, "all zero"),
        ({"weights": {"a": -1}}, "expected >= 0"),
        ({"per": "shard"}, "'example' or 'batch'"),
        ({"batch_size": 0}, "batch_size 0"),
        ({"source_name": "x"}, "source_name 'x'"),
        ({"sources": {"a": [{"x": 1}], "b": [{"y": 1}]}}, "different source names"),
        ({"sources": {"a": 3}}, "expected a Fuel dataset"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"sources": sources(), "weights": {"a": 1}, "batch_size": 2,
                            "batches_per_epoch": 2, "seed": 0, **kwargs}  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        Mixture(args.pop("sources"), args.pop("weights"), **args)


def test_weights_set_by_the_trainer_are_checked_when_a_batch_reads_them() -> None:
    mixture = Mixture(sources(), {"a": 1}, batch_size=2, batches_per_epoch=2, seed=0)
    with pytest.raises(ConfigError, match=r"params\['weights'\] at batch 0.*'web'"):
        batch(mixture, 0, ParamsLog().add(0, {"weights": {"web": 1}}))


def test_a_transformer_above_says_the_mixtures_seed_in_the_plans_fingerprint() -> None:
    def top(seed: int) -> Mapping:
        mix = Mixture(sources(), {"a": 0.5, "b": 0.5}, batch_size=5, batches_per_epoch=4, seed=seed)
        return Mapping(mix, lambda d: d)

    # Two seeds are two pipelines even under a transformer (they once shared a run).
    assert ShardPlan(top(3)).fingerprint != ShardPlan(top(99)).fingerprint
    assert ShardPlan(top(3)).fingerprint == ShardPlan(top(3)).fingerprint
    said = top(3)
    said.plan_fingerprint = {"mine": 1}  # set on the transformer: it says its own
    assert said.plan_fingerprint == {"mine": 1}
    assert ShardPlan(said).fingerprint != ShardPlan(top(3)).fingerprint
